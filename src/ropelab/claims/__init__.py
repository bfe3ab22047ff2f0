"""The seeds' claims put to tiny-scale tests: `verdict` decides each claim from measured seed replicas."""
