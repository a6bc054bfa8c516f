"""The sharded PPO update on the train slice."""
from areal_jax.trainer.batch import Trajectory
from areal_jax.trainer.config import TrainerConfig
from areal_jax.trainer.optim import make_optimizer, make_schedule
from areal_jax.trainer.state import TrainState, create_train_state
from areal_jax.trainer.trainer import Trainer

__all__ = ["Trainer", "TrainerConfig", "TrainState", "Trajectory", "create_train_state", "make_optimizer",
           "make_schedule"]
