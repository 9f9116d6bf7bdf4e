"""The job's configuration: one section per TOML table (sections.py), the TOML file (toml_file.py), and the
command line's flags derived from the sections' fields (flags.py). A model factory is called with a JobConfig."""

from pipelines.job.config.sections import ConfigError, JobConfig

__all__ = ["ConfigError", "JobConfig"]
