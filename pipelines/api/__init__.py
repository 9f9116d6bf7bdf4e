"""The training API a user's script calls (docs/api.md): wrap a model (step.wrap_model, the EmbeddingWrap of
wrap.py, the modes of modes.py), step it (step.TrainStep, with the dense all-reduce of dense_sync.py and the
numerics of numerics.py), evaluate it (evaluate.py). ``from pipelines import ...`` re-exports the public names."""
