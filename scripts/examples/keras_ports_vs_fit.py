"""The keras-io ports against Keras's own `model.fit`: same model, data,
batch order, steps, seed and optimizer, on one device and on `mirrored`,
back to back in one process.

    python scripts/examples/keras_ports_vs_fit.py \
        --cifar10_dir=/path/to/cifar-10-batches-py
    python scripts/examples/keras_ports_vs_fit.py --port=distillation,gan

Ports (`--port`, all six by default; each with its own steps and batch,
PORT_RUNS, unless `--steps` / `--batch` set them for all):

- mnist_convnet: keras-io's MNIST convnet (`mnist_convnet.build`) on
  generated MNIST-shaped uint8 arrays (`mnist_convnet.synthetic_digits`,
  `--examples`; written to an .npz that distloop reads as `--dataset=numpy`).
- distillation: keras-io's knowledge distillation of
  `mnist_convnet.build_student` from a teacher (`mnist_convnet.build`
  trained first by `fit` for `--teacher_steps`): keras-io's `Distiller`
  model (a `compute_loss` override) under `fit` against distillation.py's
  `Distiller` trainer; the same digits.
- resnet50: `keras.applications.ResNet50` (random weights, 32x32x3, 10
  classes, logits) by name (`--model=keras.applications:ResNet50`) on
  CIFAR-10 (`--cifar10_dir`, the python-pickle layout; default Keras's
  cache).
- gan: gan.py's `GANTrainer` (semi-supervised GAN: `mnist_convnet.build`
  as discriminator and classifier, `gan.build_generator`) against the same
  two models and losses as a keras.Model with its own `train_step` under
  `fit` (keras-io's "GAN overriding Model.train_step" form); the same digits.
- vit: keras-io's Vision Transformer at a small size (`vit_cifar10.build`,
  `--vit_layers` transformer layers:
  an unadapted `Normalization` that distloop adapts on its first
  `--adapt_examples` training images and fit's side adapts on the same
  images, random flip / rotation / zoom, `Patches`, `PatchEncoder`) with
  AdamW on CIFAR-10 (`--cifar10_dir`).
- vae: keras-io's Variational AutoEncoder (`vae.build` the encoder with its
  `Sampling` layer, `vae.build_decoder`): vae.py's `VAETrainer` (a
  `compute_loss`, the decoder tracked) against keras-io's `VAE(keras.Model)`
  with its own `train_step` under `fit`; the same digits without labels.

`fit` reads the batches distloop reads, in its order
(`framework.data.inputs.train_dataset`: a (seed, epoch) shuffle, uint8
divided by 255). Op determinism is on for both (distloop's default).
Prints the host, the command, then one table row per (port, strategy,
trainer): the train loss and accuracy (the VAE's loss / reconstruction /
kl; and the GAN's d_loss / g_loss) as
means over the second half of the steps, test loss and accuracy after the
steps (the whole test split), the examples/s of the second half of the
steps (the first half includes tracing) with distloop's as a ratio of
fit's, and the run's wall time (build, steps, evaluation).
docs/results/keras_ports.md records a run.
"""

import json
import os
import platform
import shlex
import sys
import tempfile
import time

# The installed package only (`pip install -e .`): a copy of this file runs
# from any folder.
from distloop_cli import cli
cli.quiet_startup()

from absl import app, flags  # pylint: disable=g-import-not-at-top

PORTS = ("mnist_convnet", "distillation", "resnet50", "gan", "vit", "vae")
# Each port's (steps, global batch): ResNet50 and the ViT from scratch need
# a few hundred CIFAR-10 steps to leave chance; the rest learn the digits in
# 200.
PORT_RUNS = {"mnist_convnet": (200, 64), "distillation": (200, 64),
             "resnet50": (500, 64), "gan": (200, 64), "vit": (400, 64),
             "vae": (200, 64)}
CIFAR10_PORTS = ("resnet50", "vit")
flags.DEFINE_list("port", list(PORTS), f"Ports to run, of {', '.join(PORTS)}.")
flags.DEFINE_integer("steps", None, "Training steps of every run (default: "
                     "each port's, PORT_RUNS).", lower_bound=2)
flags.DEFINE_integer("batch", None, "Global batch size of every run "
                     "(default: each port's, PORT_RUNS).", lower_bound=2)
flags.DEFINE_integer("examples", 4096, "Generated training digits (a "
                     "quarter as many test ones).")
flags.DEFINE_string("cifar10_dir", None, "resnet50, vit: the CIFAR-10 python "
                    "directory (cifar-10-batches-py; default: Keras's "
                    "cache, downloaded when online). Not --data_dir: "
                    "train.py's flag, which the distillation and GAN ports "
                    "define when they load.")
flags.DEFINE_integer("run_seed", 0, "Seed of both trainers (weights, batch "
                     "order).")
flags.DEFINE_integer("teacher_steps", 200, "distillation: the teacher's "
                     "training steps (model.fit, one device).")
flags.DEFINE_integer("vit_layers", 4, "vit: its transformer layers "
                     "(vit_cifar10.build's transformer_layers), both sides.",
                     lower_bound=1)


@flags.validator("port")
def _check_ports(ports):
  unknown = [p for p in ports if p not in PORTS]
  if unknown or not ports:  # absl's line names the flag and its value
    what = f"unknown port {', '.join(unknown)}" if unknown else "no port"
    raise flags.ValidationError(f"{what}; valid: {', '.join(PORTS)}")
  return True


ALPHA, TEMPERATURE = 0.1, 10.0  # keras-io's distillation
LEARNING_RATE = 1e-3  # Adam's (the ViT's AdamW's), of every model
WEIGHT_DECAY = 1e-4  # keras-io's ViT's AdamW
FLAGS = flags.FLAGS


def host_line():
  """CPU, cores, the CPU's vector flags, TensorFlow and Keras versions."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  model, cpu_flags = platform.processor() or platform.machine(), []
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          model = value.strip()
        elif key.strip() == "flags":
          cpu_flags = value.split()
          break
  except OSError:
    pass
  vector = [f for f in cpu_flags if f.startswith(("avx", "amx", "fma"))]
  return (f"host: {model}, {len(os.sched_getaffinity(0))} cores, CPU flags "
          f"{' '.join(vector) or 'none of avx/amx/fma'}; TensorFlow "
          f"{tf.__version__}, Keras {keras.__version__}; load average "
          f"{os.getloadavg()[0]:.2f}")


def _digits(path, labels=True):
  """Writes the generated digits to `path` (.npz of the numpy contract;
  without `labels`, the images alone: unlabeled data)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  (x, y), (x_test, y_test) = mnist_convnet.synthetic_digits(FLAGS.examples)
  if labels:
    np.savez(path, x_train=x, y_train=y, x_test=x_test, y_test=y_test)
  else:
    np.savez(path, x_train=x, x_test=x_test)


class Port:
  """One port's steps, batch and data (loaded as distloop loads it).

  Args:
    name: one of PORTS.
    digits: the generated digits' .npz.
    unlabeled: the same digits without labels (the VAE's).
  """

  def __init__(self, name, digits, unlabeled):
    from framework.data import datasets  # pylint: disable=g-import-not-at-top
    self.name = name
    steps, batch = PORT_RUNS[name]
    self.steps = FLAGS.steps or steps
    self.batch = FLAGS.batch or batch
    if name in CIFAR10_PORTS:
      self.dataset_name, self.data_dir = "cifar10", FLAGS.cifar10_dir
      self.data_label = "CIFAR-10"
    elif name == "vae":
      self.dataset_name, self.data_dir = "numpy", unlabeled
      self.data_label = "digits, no labels"
    else:
      self.dataset_name, self.data_dir = "numpy", digits
      self.data_label = "digits"
    self.data = datasets.load_dataset(self.dataset_name,
                                      data_dir=self.data_dir)
    self.input_shape = self.data.input_shape
    self.num_classes = self.data.num_classes

  def fit_input(self):
    """distloop's training batches, in its order, for `fit`."""
    from framework.data import inputs  # pylint: disable=g-import-not-at-top
    return inputs.train_dataset(self.data, self.batch, seed=FLAGS.run_seed)

  def adapt_images(self):
    """The images distloop adapts a `Normalization` on: the first
    `adapt_examples` (its default) of the first epoch's batches."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    import framework  # pylint: disable=g-import-not-at-top
    from framework import settings  # pylint: disable=g-import-not-at-top
    from framework.data import inputs  # pylint: disable=g-import-not-at-top
    wanted = settings.default(framework.ExperimentConfig, "adapt_examples")
    per_epoch = inputs.steps_per_epoch(self.data.num_train_examples,
                                       self.batch)
    images = np.concatenate([
        np.asarray(x) for x, _ in self.fit_input().take(per_epoch)
        .take(-(-wanted // self.batch))])
    return images[:wanted]

  def test_split(self):
    """The whole test split: images as float32 in [0, 1], labels (None for
    unlabeled data)."""
    import numpy as np  # pylint: disable=g-import-not-at-top
    x = np.asarray(self.data.test_x)
    y = None if self.data.test_y is None else np.asarray(self.data.test_y)
    if x.dtype == np.uint8:
      x = x.astype(np.float32) / 255
    return x, y


def _distloop(port, strategy_name, strategy):
  """distloop's run of `port`: (test loss, test accuracy, examples/s of
  the last loop, {d_loss, g_loss of the last loop} for the GAN)."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import functools  # pylint: disable=g-import-not-at-top
  import framework  # pylint: disable=g-import-not-at-top
  from framework.app import experiment  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  model_dir = tempfile.mkdtemp()
  half = port.steps // 2
  config = framework.ExperimentConfig(
      dataset=port.dataset_name, data_dir=port.data_dir, model_dir=model_dir,
      strategy=strategy_name, global_batch_size=port.batch,
      train_steps=port.steps, seed=FLAGS.run_seed, export_saved_model=False,
      optimizer=framework.OptimizerConfig(name="adam",
                                          learning_rate=LEARNING_RATE),
      # The last loop is the second half: no log or summary interval
      # (100 steps by default) may end a loop before it.
      loop=framework.LoopConfig(train_steps=port.steps, steps_per_loop=half,
                                log_every=half, summary_every=half,
                                checkpoint_every=0))
  if port.name == "distillation":
    import distillation  # pylint: disable=g-import-not-at-top
    results = experiment.run(
        config, strategy=strategy, build_model=mnist_convnet.build_student,
        trainer_cls=functools.partial(
            distillation.Distiller, teacher_model="mnist_convnet:build",
            teacher_weights=TEACHER, alpha=ALPHA,
            distillation_temperature=TEMPERATURE))
  elif port.name == "gan":
    import gan  # pylint: disable=g-import-not-at-top
    results = experiment.run(
        config, strategy=strategy, build_model=mnist_convnet.build,
        trainer_cls=functools.partial(
            gan.GANTrainer, latent_dim=gan.FLAGS.latent_dim,
            generator_learning_rate=LEARNING_RATE))
  elif port.name == "resnet50":
    results = experiment.run(dataclasses.replace(
        config, model="keras.applications:ResNet50"), strategy=strategy)
  elif port.name == "vit":
    import vit_cifar10  # pylint: disable=g-import-not-at-top
    results = experiment.run(dataclasses.replace(
        config, optimizer=framework.OptimizerConfig(
            name="adamw", learning_rate=LEARNING_RATE,
            weight_decay=WEIGHT_DECAY),
        # Keras's AdamW under fit decays every variable.
        weight_decay_exclude="^$",
        model_options={"transformer_layers": FLAGS.vit_layers}),
                             strategy=strategy, build_model=vit_cifar10.build)
  elif port.name == "vae":
    import vae  # pylint: disable=g-import-not-at-top
    results = experiment.run(config, vae.VAETrainer, strategy=strategy,
                             build_model=vae.build)
  else:
    results = experiment.run(config, strategy=strategy,
                             build_model=mnist_convnet.build)
  last = {}  # the last loop's train scalars: steps half+1..steps
  with open(os.path.join(model_dir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if row["split"] == "train":
        last[row["name"]] = row["value"]
  return dict(test_loss=results["loss"],
              test_accuracy=results.get("accuracy"),
              speed=last["examples_per_second"],
              **{name: last.get(name) for name in TRAIN_METRICS})


def _fit(port, strategy):
  """`model.fit`'s run of `port`: as `_distloop`."""
  import keras  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(FLAGS.run_seed)
  cross_entropy = keras.losses.SparseCategoricalCrossentropy(
      from_logits=True)
  shape, classes = port.input_shape, port.num_classes
  with strategy.scope():
    if port.name == "distillation":
      # Student first, as distloop builds them (the same initial weights).
      student = mnist_convnet.build_student(shape, classes)
      teacher = mnist_convnet.build(shape, classes)
      teacher.load_weights(TEACHER)
      model = _KERAS_IO["distiller"](student, teacher)
      model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE),
                    metrics=["accuracy"])
    elif port.name == "gan":
      import gan  # pylint: disable=g-import-not-at-top
      model = _KERAS_IO["gan"](
          mnist_convnet.build(shape, classes),
          gan.build_generator(gan.FLAGS.latent_dim, shape),
          gan.FLAGS.latent_dim)
      model.compile(d_optimizer=keras.optimizers.Adam(LEARNING_RATE),
                    g_optimizer=keras.optimizers.Adam(LEARNING_RATE))
    elif port.name == "vit":
      import vit_cifar10  # pylint: disable=g-import-not-at-top
      model = vit_cifar10.build(shape, classes,
                                transformer_layers=FLAGS.vit_layers)
      # keras-io: data_augmentation.layers[0].adapt(x_train); here on the
      # images distloop adapts it on.
      model.get_layer("data_augmentation").layers[0].adapt(
          port.adapt_images())
      model.compile(
          optimizer=keras.optimizers.AdamW(learning_rate=LEARNING_RATE,
                                           weight_decay=WEIGHT_DECAY),
          loss=cross_entropy, metrics=["accuracy"])
    elif port.name == "vae":
      import vae  # pylint: disable=g-import-not-at-top
      # The encoder first, as distloop builds them.
      encoder = vae.build(shape, classes)
      model = _KERAS_IO["vae"](encoder, vae.build_decoder(
          encoder.outputs[0].shape[-1], shape))
      model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE))
    else:
      if port.name == "resnet50":
        model = keras.applications.ResNet50(
            weights=None, input_shape=shape, classes=classes,
            classifier_activation=None)
      else:
        model = mnist_convnet.build(shape, classes)
      model.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE),
                    loss=cross_entropy, metrics=["accuracy"])
  half, steps = port.steps // 2, port.steps
  times = {}

  class Clock(keras.callbacks.Callback):
    """The time at the end of steps `half` and `steps`; the metrics start
    again after step `half` (the GAN's losses: the second half's mean)."""

    def on_train_batch_end(self, batch, logs=None):
      if batch + 1 in (half, steps):
        times[batch + 1] = time.perf_counter()
      if batch + 1 == half:
        for metric in self.model.metrics:
          metric.reset_state()

  history = model.fit(port.fit_input(), epochs=1, steps_per_epoch=steps,
                      verbose=0, callbacks=[Clock()])
  logs = dict(history.history)
  if port.name == "vae":  # keras-io's names
    logs["reconstruction"] = logs.pop("reconstruction_loss")
    logs["kl"] = logs.pop("kl_loss")
  train = {name: logs.get(name, [None])[-1] for name in TRAIN_METRICS}
  if port.name in ("distillation", "gan"):  # the classifier, on its loss
    model = model.student if port.name == "distillation" else (
        model.discriminator)
    with strategy.scope():
      model.compile(loss=cross_entropy, metrics=["accuracy"])
  x_test, y_test = port.test_split()
  if port.name == "vae":  # keras-io's VAE has no test_step
    loss, accuracy = _vae_test_loss(model, x_test, port.batch), None
  else:
    loss, accuracy = model.evaluate(x_test, y_test, batch_size=port.batch,
                                    verbose=0)
  speed = (steps - half) * port.batch / (times[steps] - times[half])
  return dict(test_loss=loss, test_accuracy=accuracy, speed=speed, **train)


def _vae_test_loss(model, x_test, batch):
  """The mean reconstruction + KL loss over the test images, the
  encoder's z sampled as in training (distloop's evaluation: the mean of
  `VAETrainer.compute_loss`)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import vae  # pylint: disable=g-import-not-at-top
  total = 0.0
  for start in range(0, len(x_test), batch):
    images = x_test[start:start + batch]
    z_mean, z_log_var, z = model.encoder(images, training=True)
    error, kl = vae.vae_losses(images, model.decoder(z, training=True),
                               z_mean, z_log_var)
    total += float(np.sum(error + kl))
  return total / len(x_test)


# The train scalars both sides report, as means over steps steps/2+1..steps
# (distloop: its last loop; fit: its logs, the metrics reset at steps/2).
TRAIN_METRICS = ("loss", "accuracy", "d_loss", "g_loss", "reconstruction",
                 "kl")
TEACHER = None  # the teacher's weights file (distillation)
# keras-io's model classes, made once TensorFlow is set up.
_KERAS_IO = {}


def _keras_io_distiller():
  """keras-io's `Distiller` (Keras 3 version: a `compute_loss` override)."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import ops  # pylint: disable=g-import-not-at-top

  class Distiller(keras.Model):

    def __init__(self, student, teacher):
      super().__init__()
      self.teacher = teacher
      self.student = student
      self.teacher.trainable = False

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     allow_empty=False):
      teacher_pred = self.teacher(x, training=False)
      student_loss = keras.losses.SparseCategoricalCrossentropy(
          from_logits=True)(y, y_pred)
      distillation_loss = keras.losses.KLDivergence()(
          ops.softmax(teacher_pred / TEMPERATURE, axis=1),
          ops.softmax(y_pred / TEMPERATURE, axis=1)) * TEMPERATURE ** 2
      return ALPHA * student_loss + (1 - ALPHA) * distillation_loss

    def call(self, x):
      return self.student(x)

  return Distiller


def _keras_io_gan():
  """keras-io's "GAN overriding Model.train_step" form (a keras.Model with
  `compile(d_optimizer, g_optimizer)`, Mean trackers and its own
  `train_step`) with gan.py's semi-supervised losses and noise: the
  discriminator's logits classify, and D = sigmoid(logsumexp(logits)) says
  "real"; the same two updates per step as `gan.GANTrainer`. Keras's loss
  objects scale each replica's mean by 1 / replicas and its optimizers sum
  the gradients over the replicas, so the update is the global batch's."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import gan  # pylint: disable=g-import-not-at-top

  class GAN(keras.Model):

    def __init__(self, discriminator, generator, latent_dim):
      super().__init__()
      self.discriminator = discriminator
      self.generator = generator
      self.latent_dim = latent_dim
      self.classify_loss = keras.losses.SparseCategoricalCrossentropy(
          from_logits=True)
      self.real_loss = keras.losses.BinaryCrossentropy(from_logits=True)

    def compile(self, d_optimizer, g_optimizer):
      super().compile()
      self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
      # Built here, under the strategy's scope: built lazily inside a
      # replica's step they fail under MirroredStrategy (keras#19246).
      d_optimizer.build(self.discriminator.trainable_variables)
      g_optimizer.build(self.generator.trainable_variables)
      self.trackers = {name: keras.metrics.Mean(name=name)
                       for name in TRAIN_METRICS}

    @property
    def metrics(self):
      return list(self.trackers.values())

    def call(self, images):
      return self.discriminator(images)  # a classifier's logits

    def _says_real(self, logits, target):
      """Binary cross-entropy of D against `target` (1 real, 0 fake), D's
      logit the logsumexp of the class `logits`."""
      score = tf.reduce_logsumexp(logits, axis=-1, keepdims=True)
      return self.real_loss(tf.fill(tf.shape(score), target), score)

    def train_step(self, data):
      images, labels = data
      noise = gan.noise(self.d_optimizer.iterations, tf.shape(images)[0],
                        self.latent_dim)
      fake = self.generator(noise, training=True)
      d_vars = self.discriminator.trainable_variables
      with tf.GradientTape() as tape:
        logits = self.discriminator(images, training=True)
        classify = self.classify_loss(labels, logits)
        d_loss = classify + self._says_real(logits, 1.0) + self._says_real(
            self.discriminator(fake, training=True), 0.0)
      self.d_optimizer.apply_gradients(zip(tape.gradient(d_loss, d_vars),
                                           d_vars))
      g_vars = self.generator.trainable_variables
      with tf.GradientTape() as tape:
        g_loss = self._says_real(self.discriminator(
            self.generator(noise, training=True), training=True), 1.0)
      self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, g_vars),
                                           g_vars))
      # The losses are scaled by 1 / replicas (see above): the trackers
      # get the replica's own mean.
      replicas = tf.distribute.get_strategy().num_replicas_in_sync
      for name, value in (("loss", classify), ("d_loss", d_loss),
                          ("g_loss", g_loss)):
        self.trackers[name].update_state(value * replicas)
      self.trackers["accuracy"].update_state(tf.cast(tf.equal(
          tf.argmax(logits, axis=-1, output_type=labels.dtype), labels),
                                                     tf.float32))
      return {name: m.result() for name, m in self.trackers.items()}

  return GAN


def _keras_io_vae():
  """keras-io's `VAE(keras.Model)`, as keras-io writes it: Mean trackers
  and its own `train_step` (the batch mean of each loss; under `mirrored`
  Keras's optimizer sums the replicas' gradients, see
  docs/results/keras_ports.md), plus the `call` that `fit` under a
  strategy needs."""
  import keras  # pylint: disable=g-import-not-at-top
  from keras import ops  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  class VAE(keras.Model):

    def __init__(self, encoder, decoder, **kwargs):
      super().__init__(**kwargs)
      self.encoder = encoder
      self.decoder = decoder
      self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
      self.reconstruction_loss_tracker = keras.metrics.Mean(
          name="reconstruction_loss")
      self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
      return [self.total_loss_tracker, self.reconstruction_loss_tracker,
              self.kl_loss_tracker]

    def call(self, data):
      # Not in keras-io's class: under a tf.distribute strategy, `fit`
      # builds the model symbolically first and fails on a model without
      # `call` ("Unable to automatically build the model").
      return self.decoder(self.encoder(data)[2])

    def train_step(self, data):
      with tf.GradientTape() as tape:
        z_mean, z_log_var, z = self.encoder(data)
        reconstruction = self.decoder(z)
        reconstruction_loss = ops.mean(ops.sum(
            keras.losses.binary_crossentropy(data, reconstruction),
            axis=(1, 2)))
        kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean)
                          - ops.exp(z_log_var))
        kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
        total_loss = reconstruction_loss + kl_loss
      grads = tape.gradient(total_loss, self.trainable_weights)
      self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
      self.total_loss_tracker.update_state(total_loss)
      self.reconstruction_loss_tracker.update_state(reconstruction_loss)
      self.kl_loss_tracker.update_state(kl_loss)
      return {"loss": self.total_loss_tracker.result(),
              "reconstruction_loss":
                  self.reconstruction_loss_tracker.result(),
              "kl_loss": self.kl_loss_tracker.result()}

  return VAE


def _train_teacher(port):
  """The teacher's weights file: mnist_convnet.build after `fit`."""
  import keras  # pylint: disable=g-import-not-at-top
  import mnist_convnet  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(FLAGS.run_seed + 1)
  teacher = mnist_convnet.build(port.input_shape, port.num_classes)
  teacher.compile(optimizer=keras.optimizers.Adam(LEARNING_RATE),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  x, y = port.data.train_x, port.data.train_y
  teacher.fit(x[:].astype("float32") / 255, y[:], batch_size=port.batch,
              epochs=1, steps_per_epoch=FLAGS.teacher_steps, verbose=0)
  path = os.path.join(tempfile.mkdtemp(), "teacher.weights.h5")
  teacher.save_weights(path)
  return path


def _pair(run, *names):
  """`first / second [/ ...]` of a run's train scalars, or "" without
  them."""
  if run[names[0]] is None:
    return ""
  return " / ".join(f"{run[name]:.4f}" for name in names)


def main(argv):
  del argv
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import framework  # pylint: disable=g-import-not-at-top
  framework.configure_cpu_devices(2)
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  tf.get_logger().setLevel("ERROR")
  # distloop's default (ExperimentConfig.deterministic), on for fit too: it
  # stays on in the process once a distloop run sets it.
  tf.config.experimental.enable_op_determinism()
  print(host_line())
  print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
  print("\n| port | data | strategy | trainer | steps x batch | train loss "
        "/ accuracy (VAE: loss / reconstruction / kl), 2nd half | test loss "
        "| test accuracy | GAN d_loss / "
        "g_loss, 2nd half | examples/s, 2nd half | distloop / fit | wall s |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|")
  digits = os.path.join(tempfile.mkdtemp(), "digits.npz")
  _digits(digits)
  unlabeled = os.path.join(tempfile.mkdtemp(), "digits_unlabeled.npz")
  _digits(unlabeled, labels=False)
  global TEACHER  # pylint: disable=global-statement
  start = time.perf_counter()
  for name in FLAGS.port:
    port = Port(name, digits, unlabeled)
    if name == "distillation" and TEACHER is None:
      TEACHER = _train_teacher(port)
      _KERAS_IO["distiller"] = _keras_io_distiller()
    if name == "gan" and "gan" not in _KERAS_IO:
      _KERAS_IO["gan"] = _keras_io_gan()
    if name == "vae" and "vae" not in _KERAS_IO:
      _KERAS_IO["vae"] = _keras_io_vae()
    for strategy_name in ("default", "mirrored"):
      strategy = framework.make_strategy(strategy_name)
      rows = []
      for trainer, run in (("model.fit", _fit), ("distloop", _distloop)):
        began = time.perf_counter()
        args = (port, strategy) if run is _fit else (port, strategy_name,
                                                     strategy)
        rows.append((trainer, run(*args), time.perf_counter() - began))
      for trainer, run, wall in rows:
        ratio = (f"{run['speed'] / rows[0][1]['speed']:.2f}"
                 if trainer == "distloop" else "")
        train = (_pair(run, "loss", "reconstruction", "kl")
                 if name == "vae" else _pair(run, "loss", "accuracy"))
        accuracy = ("" if run["test_accuracy"] is None
                    else f"{run['test_accuracy']:.4f}")
        print(f"| {name} | {port.data_label} | {strategy_name} | {trainer} | "
              f"{port.steps} x {port.batch} | {train}"
              f" | {run['test_loss']:.4f} | {accuracy} | "
              f"{_pair(run, 'd_loss', 'g_loss')} | {run['speed']:.0f} | "
              f"{ratio} | {wall:.0f} |", flush=True)
  print(f"\ntotal {time.perf_counter() - start:.0f} s; {host_line()}")


if __name__ == "__main__":
  cli.run_app(main)
