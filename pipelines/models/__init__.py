"""The reference models: the jagged sequence model (reference.py), built through the public API like a user's,
and torchrec's own TrainPipelineSparseDist around it as the outside reference (torchrec_ref.py), and torchrec's
prioritized embedding communication (PEC) beside FreeScale's prioritized updates (torchrec_pec.py)."""
