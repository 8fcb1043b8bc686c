"""Errors eprt raises for bad input. Each message names the file, tensor or setting and the way out."""


class EprtError(Exception):
    """Base of every refusal eprt makes on purpose."""


class ConfigError(EprtError):
    """A config.json or setting eprt cannot run as written."""


class CheckpointError(EprtError):
    """A weight file or manifest that is missing, corrupt, or disagrees with the config."""


class OutputExistsError(EprtError):
    """The output directory exists and is not empty."""
