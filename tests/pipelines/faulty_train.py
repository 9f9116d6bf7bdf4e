"""`pipelines.job.train` with one rank killed mid-step on the first attempt (for the restart test).

    torchrun ... -m tests.pipelines.faulty_train --fault-rank 1 --fault-step 5 <train flags>

The process dies hard (os._exit, no cleanup) inside train_step of step ``--fault-step`` on rank
``--fault-rank``, only while TORCHELASTIC_RESTART_COUNT is 0, as a crashed or preempted rank would.
"""

import argparse
import os
import sys

from pipelines.job import trainer as trainer_module
from pipelines.job.train import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault-rank", type=int, required=True)
    parser.add_argument("--fault-step", type=int, required=True)
    add_arguments(parser)
    args = parser.parse_args()
    original = trainer_module.Trainer.train_step

    def train_step(self, fetched, upcoming):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and self.rank == args.fault_rank and self.step == args.fault_step:
            os._exit(17)
        return original(self, fetched, upcoming)

    trainer_module.Trainer.train_step = train_step
    sys.exit(main(args))
