"""Training: `train(TrainOptions(...))`, the token-stream data pipeline and the LR schedule."""

from switchhead.train.loop import TrainOptions, TrainResult, evaluate, train
from switchhead.train.schedule import lr_at

__all__ = ["TrainOptions", "TrainResult", "evaluate", "lr_at", "train"]
