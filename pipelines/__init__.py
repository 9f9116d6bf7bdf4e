"""pipelines: the staged train pipeline, reference model, CLI, benchmarks and simulator."""
