"""Sealed folders on disk: model folders, their manifests and the training checkpoints."""
