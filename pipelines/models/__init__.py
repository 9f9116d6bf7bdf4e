"""The built-in models: the softmax model (softmax.py: a causal softmax transformer over the jagged UIH) and HSTU
(hstu.py), both built through the public API like a user's; torchrec's own TrainPipelineSparseDist around the
softmax model as the outside baseline (torchrec_baseline.py), and torchrec's prioritized embedding communication
(PEC) beside FreeScale's prioritized updates (torchrec_pec.py)."""
