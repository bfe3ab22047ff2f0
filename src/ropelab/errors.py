"""Errors the CLI reports as one line. Configuration mistakes are `ropelab.config.ConfigError`."""


class TrainingDiverged(RuntimeError):
    """Too many consecutive bad (non-finite or spiking) steps; the last good weights are in the
    run's latest checkpoint."""
