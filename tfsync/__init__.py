"""tfsync: relaxed synchronization for Keras 3 / TensorFlow data-parallel training on Horovod."""

__version__ = "0.1.0"
