"""What both jobs share: the run folder and loop, engines and the weight sync, checkpoints, metrics, data."""
