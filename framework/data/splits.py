"""What a dataset held as arrays (in memory or memory-mapped) tells about
itself: the interface `framework.data.file_input`'s datasets share."""


class ArraySplits:
  """Shapes and sizes read from `train_x`, `train_y`, `test_x`, `test_y`
  and `class_names` attributes."""

  @property
  def input_shape(self):
    return tuple(self.train_x.shape[1:])

  @property
  def label_shape(self):
    return tuple(self.train_y.shape[1:])

  @property
  def num_classes(self):
    return len(self.class_names)

  @property
  def num_train_examples(self):
    return len(self.train_x)

  @property
  def num_test_examples(self):
    return len(self.test_x)

  def test_samples(self, n):
    return self.test_x[:n], self.test_y[:n]
