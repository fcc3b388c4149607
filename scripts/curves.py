"""Reading and drawing accuracy curves from a run's TensorBoard event files.

Shared by `plot_curves.py` and the benchmarks that compare runs; no flags.
"""

import glob
import os

import numpy as np
from PIL import Image, ImageDraw, ImageFont

COLORS = {"train": (31, 119, 180), "test": (255, 127, 14)}
PALETTE = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40))


def read_scalars(logdir):
  """{tag: [(step, value)]} and {tag: text} from the event files in `logdir`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  scalars, texts = {}, {}
  for path in sorted(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        array = tf.make_ndarray(value.tensor)
        if array.dtype == object:
          texts[value.tag] = array.item().decode()
        elif array.ndim:  # a histogram (e.g. --log_layer_norms), no curve
          continue
        else:
          scalars.setdefault(value.tag, []).append(
              (event.step, float(array)))
  return ({tag: sorted(dict(points).items()) for tag, points in
           scalars.items()}, texts)


def per_epoch(points, steps_per_epoch):
  """{epoch: mean value} of the points whose step falls in each epoch."""
  epochs = {}
  for step, value in points:
    epoch = int(np.ceil(step / steps_per_epoch))
    epochs.setdefault(epoch, []).append(value)
  return {epoch: float(np.mean(v)) for epoch, v in sorted(epochs.items())}


def is_fraction(tag, values):
  """Whether a curve of `tag` reads as a percentage (an accuracy in [0, 1])."""
  return "accuracy" in tag and all(0.0 <= v <= 1.0 for v in values)


def format_value(value, percent):
  return f"{100 * value:.2f}%" if percent else f"{value:.4g}"


def _y_range(all_y, percent):
  if percent:  # tenths of 100 %
    y_min = np.floor(min(all_y) * 10) / 10
    y_max = min(1.0, np.ceil(max(all_y) * 10) / 10)
    if y_max <= y_min:
      y_min, y_max = (y_max - 0.1, y_max) if y_max >= 0.1 else (0.0, 0.1)
    return y_min, y_max
  # Any scale (a loss, a perplexity): a round step of about a tenth.
  low, high = min(all_y), max(all_y)
  span = high - low or abs(high) or 1.0
  step = 10 ** np.floor(np.log10(span / 10))
  # At least half a step of room: no point on the frame.
  y_min = np.floor(low / step - 0.5) * step
  y_max = np.ceil(high / step + 0.5) * step
  return y_min, y_max


def draw(curves, path, title, width=900, height=560, x_label="epoch",
         percent=True):
  """A line plot of {name: {x: value}} as a PNG (PIL only); x: epochs, or
  any other number >= 0 (e.g. seconds, steps) named by `x_label`; y: a
  fraction shown in percent, or (`percent=False`) values of any scale."""
  image = Image.new("RGB", (width, height), "white")
  pen = ImageDraw.Draw(image)
  font = ImageFont.load_default()
  left, right, top, bottom = 70, width - 30, 40, height - 60
  all_x = [x for c in curves.values() for x in c] or [1]
  all_y = [y for c in curves.values() for y in c.values()] or [0, 1]
  x_max = int(np.ceil(max(all_x)))
  y_min, y_max = _y_range(all_y, percent)
  to_px = lambda x, y: (left + (right - left) * x / max(x_max, 1),
                        bottom - (bottom - top) * (y - y_min) / (y_max - y_min))
  for i in range(11):  # grid and y labels
    y = y_min + (y_max - y_min) * i / 10
    _, py = to_px(0, y)
    pen.line([(left, py), (right, py)], fill=(230, 230, 230))
    label = f"{100 * y:.0f}%" if percent else f"{y:.4g}"
    pen.text((8, py - 6), label, fill="black", font=font)
  for x in range(0, x_max + 1, max(1, int(np.ceil(x_max / 10)))):  # x labels
    px, _ = to_px(x, y_min)
    pen.line([(px, bottom), (px, bottom + 5)], fill="black")
    pen.text((px - 4, bottom + 10), str(x), fill="black", font=font)
  pen.rectangle([left, top, right, bottom], outline="black")
  pen.text((width // 2 - 20, height - 25), x_label, fill="black", font=font)
  pen.text((left, 12), title, fill="black", font=font)
  # The legend goes in the corner the curves end away from (bottom right
  # for rising ones, top right for falling ones: a loss, a perplexity).
  ends = [c[max(c)] for c in curves.values() if c]
  falling = bool(ends) and np.mean(ends) < (y_min + y_max) / 2
  for row, (name, curve) in enumerate(curves.items()):
    color = COLORS.get(name, PALETTE[row % len(PALETTE)])
    points = [to_px(x, y) for x, y in sorted(curve.items())]
    if len(points) > 1:
      pen.line(points, fill=color, width=2)
    for px, py in points:
      pen.ellipse([px - 2, py - 2, px + 2, py + 2], fill=color)
    last = curve[max(curve)] if curve else float("nan")
    legend_y = (top + 14 if falling else bottom - 50) + 18 * row
    pen.line([(right - 190, legend_y), (right - 165, legend_y)], fill=color,
             width=3)
    pen.text((right - 158, legend_y - 6),
             f"{name} (last {format_value(last, percent)})", fill="black",
             font=font)
  image.save(path)
