"""The job config: sections that are the TOML tables, keys and paths of before refused as unknown, one validation
whose errors name paths in Python and flags on the command line, and flags derived outside the config's classes."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import pickle
import textwrap

import pytest

from pipelines.cli import build_parser
from pipelines.job.config import sections as job_config
from pipelines.job.config.flags import FLAGS, config_from_args, flag
from pipelines.job.config.sections import SECTIONS, ConfigError, JobConfig, config_fields
from pipelines.job.config.toml_file import read_toml

# `freescale train`'s options; those from before the config's sections became its tables stay, as users' scripts
# use them; a tuning knob's flag names the table of the component it tunes.
OPTIONS = """
-h --help --config --help-tuning --data --preset --num-samples --collision-rate --uih-cap --data-seed --id-overflow
--drop-bad-samples --no-drop-bad-samples --unordered-timestamps --eval-data --model --num-items --dim --num-layers
--max-uih --attention
--positions
--batch-size --prefetch-depth --partitioner --alpha --autotune --no-autotune --min-gain --memory-budget --mode
--embedding-optimizer --embedding-lr --nproc --nnodes --node-rank --rdzv-endpoint --steps --warmup-steps --lr --seed
--device --precision --deterministic
--no-deterministic --eval-every --summary-json --metrics-jsonl --progress --no-progress --checkpoint-dir
--checkpoint-every --resume --async-checkpoint --no-async-checkpoint --export --trace --comm-timeout-s --verbose
--no-verbose --log-dir --transport
--loader.pin-memory --loader.no-pin-memory --loader.background-stages --loader.no-background-stages
--loader.worker-start --loader.stage-lookahead --loader.no-stage-lookahead
--embeddings.early-start --embeddings.exclusive-start --embeddings.schedule
--dense-sync.allreduce-start --dense-sync.bucket-mb --kernels.attention-impl --model.residual
--process.threads --process.gil-switch-ms --process.numa-binding
""".split()


def _parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def _train_parser():
    parser = build_parser()
    return next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices["train"]


def test_every_section_is_a_toml_table_at_its_attribute_path_with_a_docstring_per_field():
    from fsdata.loader import LoaderConfig

    config = JobConfig()
    assert [f.name for f in dataclasses.fields(JobConfig)] == list(SECTIONS)
    for table, cls in SECTIONS.items():
        assert isinstance(getattr(config, table), cls)
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        body = tree.body[0].body
        for i, node in enumerate(body):  # torchtitan's form: each field followed by its docstring
            if isinstance(node, ast.AnnAssign) and "ClassVar" not in ast.unparse(node):
                following = body[i + 1] if i + 1 < len(body) else None
                assert isinstance(following, ast.Expr) and isinstance(following.value.value, str), (
                    f"{cls.__name__}.{node.target.id} has no docstring"
                )
    for cls in (*SECTIONS.values(), LoaderConfig):  # no CLI in the library's classes: the flags live in flags.py
        assert all(not f.metadata for f in dataclasses.fields(cls)), cls.__name__


def test_the_flags_are_the_ones_users_scripts_know_and_each_field_has_exactly_one():
    assert set(FLAGS) == set(config_fields())
    options = [option for action in _train_parser()._actions for option in action.option_strings]
    assert sorted(options) == sorted(OPTIONS)
    assert flag("checkpoint.dir") == "--checkpoint-dir" and flag("data.path") == "--data"
    assert flag("process.gil_switch_ms") == "--process.gil-switch-ms" and flag("run.seed") == "--seed"
    config = _parse("--checkpoint-dir", "ck", "--data-seed", "3", "--seed", "4", "--embedding-lr", "0.5")
    assert (config.checkpoint.dir, config.data.seed, config.run.seed, config.embeddings.lr) == ("ck", 3, 4, 0.5)


@pytest.mark.parametrize(
    "text, message",
    [
        ('[checkpoint]\ncheckpoint_dir = "a"\n', "[checkpoint] has unknown key 'checkpoint_dir'"),
        ("[data]\ndata_seed = 3\n", "[data] has unknown key 'data_seed'; did you mean seed?"),
        ('[model]\nmodel = "tiny"\n', "[model] has unknown key 'model'"),
        ("[embeddings]\nseed = 1\n", "[embeddings] has unknown key 'seed' (it belongs in [data] or [run])"),
        ("[run]\nno_progress = true\n", "[run] has unknown key 'no_progress'; write progress = false"),
        ("[run]\nsteeps = 4\n", "[run] has unknown key 'steeps'; did you mean steps?"),
        ("lr = 1.0\n", "lr = 1.0 is outside any table; it belongs in [embeddings] or [run]"),
        ("[checkpoint]\nevery = 1.5\n", "[checkpoint] every: expected an integer, got 1.5"),
    ],
)
def test_a_toml_key_out_of_place_names_where_it_belongs(tmp_path, text, message):
    toml = tmp_path / "job.toml"
    toml.write_text(text)
    with pytest.raises(ValueError) as error:
        read_toml(toml)
    assert str(error.value).startswith(f"{toml}: ") and message in str(error.value), str(error.value)


def test_the_old_python_paths_are_gone():
    config = JobConfig()
    for section, old in (
        (config, "train"),
        (config, "tuning"),
        (config.data, "data"),
        (config.data, "batch_size"),
        (config.data, "data_seed"),
        (config.data, "eval_data"),
        (config.model, "model"),
    ):
        with pytest.raises(AttributeError, match=f"has no attribute '{old}'"):
            getattr(section, old)
    for old in ("DataConfig", "ModelSection", "config_from_args", "add_config_arguments", "apply_tuning"):
        with pytest.raises(AttributeError, match=f"has no attribute '{old}'"):
            getattr(job_config, old)


def test_validation_names_paths_in_python_and_flags_on_the_command_line():
    config = JobConfig()
    config.checkpoint.every = 2
    with pytest.raises(ConfigError) as error:
        config.validate()
    assert str(error.value) == "checkpoint.every and checkpoint.resume=latest need checkpoint.dir"
    with pytest.raises(ValueError) as error:
        _parse("--checkpoint-every", "2")
    assert str(error.value) == "--checkpoint-every and --resume=latest need --checkpoint-dir"
    config = JobConfig()
    config.dense_sync.bucket_mb = -1.0
    with pytest.raises(ConfigError, match=r"^bucket_mb must be >= 0, got -1.0 \(dense_sync.bucket_mb\)$") as error:
        config.validate()
    again = pickle.loads(pickle.dumps(error.value))  # a rank's error crosses processes with its fields
    assert str(again) == str(error.value) and again.fields == ("dense_sync.bucket_mb",)
    with pytest.raises(ValueError, match=r"^bucket_mb must be >= 0, got -1.0 \(--dense-sync.bucket-mb\)$"):
        _parse("--dense-sync.bucket-mb", "-1")


def test_the_loader_and_the_balancer_get_their_own_config_from_the_sections():
    config = _parse("--batch-size", "5", "--loader.no-stage-lookahead", "--partitioner", "kk", "--min-gain", "0.1")
    loader = config.loader  # fsdata's LoaderConfig itself: its fields are declared once, there
    assert (loader.batch_size, loader.prefetch_depth, loader.stage_lookahead) == (5, 2, False)
    assert config.balancer.partitioner == "kk" and config.balancer.min_gain == 0.1
    with pytest.raises(ValueError, match=r"min_gain must be in \[0, 1\), got 1.5"):
        _parse("--min-gain", "1.5")
