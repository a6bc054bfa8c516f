"""The runtime a job runs on: device meshes (train and rollout slices), multi-process start-up and
peer-failure detection, and the cross-process helpers of multi-host runs. Nothing here knows about RL."""
