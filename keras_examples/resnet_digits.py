"""A keras-cv ResNet with RandAugment on the digits images, trained with tfsync.

    horovodrun -np 2 -H localhost:2 --gloo python keras_examples/resnet_digits.py --mode ssp

The model is what a keras-cv user builds: ``keras_cv.models.ResNetBackbone``
under ``keras_cv.models.ImageClassifier``, fed by a ``tf.data`` pipeline that
applies ``keras_cv.layers.RandAugment``.  The 8x8 digits (scikit-learn's
offline ``load_digits``) are upsampled to 32x32 RGB.  ``--mode`` takes every tfsync
mode and its flags, as ``digits.py`` does.

The ResNet's BatchNormalization layers keep moving statistics, which each
worker updates from its own batches; ``SyncCallback`` averages them over the
workers at the end of ``fit`` (``average_statistics=True``), so every replica
ends identical, statistics included.

Rank 0 prints a JSON summary line (``TFSYNC_RESULT {...}``): samples/s, time to
the target test accuracies, final test accuracy, the training loss of each
epoch, whether the replicas are identical, and the number of parameters.
"""

import argparse
import sys
import time

import keras
import numpy as np

from tfsync.launch import add_mode_arguments, check_mode_args, integer, number, stragglers_spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_mode_arguments(p)
    p.add_argument("--epochs", type=integer(1), default=8)
    p.add_argument("--batch-size", type=integer(1), default=16, help="per worker")
    p.add_argument("--lr", type=number(above=0), default=0.002, help="Adam's learning rate")
    p.add_argument("--image-size", type=int, default=32, help="the 8x8 digits are upsampled to this size")
    p.add_argument(
        "--filters",
        type=integer(1),
        nargs="+",
        default=[16, 32, 64],
        help="filters of each ResNet stack (one per stack)",
    )
    p.add_argument("--blocks", type=integer(1), nargs="+", default=None, help="blocks per stack (default: 1 each)")
    # mild augmentation: the images are 8x8 digits upsampled, and BatchNormalization's moving
    # statistics (momentum 0.99) must follow the augmented inputs within a few hundred steps
    p.add_argument("--magnitude", type=number(0, 1), default=0.15, help="RandAugment's magnitude in [0, 1]")
    p.add_argument("--augmentations-per-image", type=integer(1), default=1, help="RandAugment's layers per image")
    p.add_argument("--target-accuracy", type=number(above=0, maximum=1), nargs="+", default=[0.9, 0.95])
    p.add_argument(
        "--stragglers",
        type=stragglers_spec,
        default=None,
        help="e.g. 'base=0.02,slow=1:0.04' (default: $TFSYNC_STRAGGLERS)",
    )
    p.add_argument("--trace-dir", default=None, help="write a JSON-lines trace per worker here")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--verbose", type=int, default=0, choices=(0, 1, 2), help="Keras' fit verbosity (rank 0)")
    args = p.parse_args(argv)
    args.blocks = args.blocks or [1] * len(args.filters)
    if len(args.blocks) != len(args.filters) or min(args.filters + args.blocks) < 1:
        p.error(
            f"--filters {args.filters} and --blocks {args.blocks} describe the ResNet's stacks: give as "
            f"many positive block counts as filter counts (e.g. --filters 16 32 --blocks 1 2)"
        )
    if args.image_size < 8 or args.image_size % 4:
        p.error(f"--image-size {args.image_size}: use a multiple of 4 of at least 8 (the digits are 8x8), e.g. 32")
    check_mode_args(p, args)  # a bad mode setting stops here, before any worker starts
    return args


def images(x, size):
    """Flat 8x8 digits in [0, 1] -> size x size RGB images in [0, 1]."""
    import tensorflow as tf

    x = tf.reshape(tf.constant(x, tf.float32), (-1, 8, 8, 1))
    return tf.image.grayscale_to_rgb(tf.image.resize(x, (size, size))).numpy()


def build_model(args):
    """keras-cv's ResNet backbone (v1 blocks; ResNetV2Backbone fails on Keras 3.15) and classifier."""
    import keras_cv

    backbone = keras_cv.models.ResNetBackbone(
        stackwise_filters=args.filters,
        stackwise_blocks=args.blocks,
        stackwise_strides=[1] + [2] * (len(args.filters) - 1),
        include_rescaling=False,  # the images are already in [0, 1]
        input_shape=(args.image_size, args.image_size, 3),
    )
    model = keras_cv.models.ImageClassifier(backbone=backbone, num_classes=10, activation="softmax")
    model.compile(
        optimizer=keras.optimizers.Adam(args.lr),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def augmented(x, y, args):
    """This worker's ``tf.data`` pipeline: shuffle, batch (whole batches only), RandAugment."""
    import keras_cv
    import tensorflow as tf

    augment = keras_cv.layers.RandAugment(
        value_range=(0, 1),
        augmentations_per_image=args.augmentations_per_image,
        magnitude=args.magnitude,
        seed=args.seed,
    )
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=args.seed)
        .batch(args.batch_size, drop_remainder=True)  # every worker takes the same number of steps
        .map(lambda a, b: (augment(a, training=True), b), num_parallel_calls=tf.data.AUTOTUNE)
        .prefetch(tf.data.AUTOTUNE)
    )


def main(argv=None):
    args = parse_args(argv)
    from digits import TargetAccuracy, init_horovod, load_data  # the digits example, beside this one

    hvd = init_horovod()

    import tfsync
    from tfsync.launch import contribution_totals, describe_mode, mode_from_args, print_result

    keras.utils.set_random_seed(args.seed)
    x_local, y_local, x_test, y_test = load_data(args.batch_size)
    x_local, x_test = images(x_local, args.image_size), images(x_test, args.image_size)
    model = build_model(args)

    mode = mode_from_args(args)
    stragglers = tfsync.Stragglers.parse(args.stragglers) if args.stragglers is not None else None
    sync = tfsync.keras.SyncCallback(mode=mode, stragglers=stragglers, trace_dir=args.trace_dir)
    progress = TargetAccuracy(x_test, y_test, args.target_accuracy, len(x_local) * hvd.size())
    start = time.time()
    history = model.fit(
        augmented(x_local, y_local, args),
        epochs=args.epochs,
        shuffle=False,  # the pipeline shuffles
        verbose=args.verbose if hvd.rank() == 0 else 0,
        callbacks=[sync, progress],
    )
    wall_s = time.time() - start
    final_acc = float(model.evaluate(x_test, y_test, verbose=0)[1])
    samples = len(x_local) * args.epochs * hvd.size()
    result = {
        "mode": describe_mode(mode),
        "workers": hvd.size(),
        "parameters": int(model.count_params()),
        "samples_per_s": samples / wall_s,
        "wall_s": wall_s,
        **contribution_totals(hvd, sync.counts, args.batch_size, wall_s, samples=samples),
        "time_to_accuracy_s": {str(t): progress.reached_s[t] for t in args.target_accuracy},
        "final_accuracy": final_acc,
        "loss_per_epoch": [float(v) for v in history.history["loss"]],  # averaged over the workers
    }
    # every replica holds the same weights and statistics: compare a checksum across ranks
    checksum = float(sum(np.sum(w.astype(np.float64)) for w in model.get_weights()))
    result["replicas_identical"] = len(set(hvd.allgather_object(checksum))) == 1
    if hvd.rank() == 0:
        print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
