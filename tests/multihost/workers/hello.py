"""Plain Horovod across hosts: every rank prints its host and the allreduced sum of the ranks."""

import socket

import horovod.tensorflow as hvd
import tensorflow as tf

hvd.init()
total = int(hvd.allreduce(tf.constant(hvd.rank()), op=hvd.Sum).numpy())
print(f"hello rank={hvd.rank()} size={hvd.size()} host={socket.gethostname()} sum={total}", flush=True)
