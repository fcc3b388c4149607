"""The fields of a TFRecord sidecar (`<split>.json`) and their checks.

`problems(sidecar, split)` lists every bad field, each as one phrase naming
the field, its value and what would be valid; `framework.data.tfrecords`
joins them into one `DataError` line. The integrity fields (written by
make_tfrecords.py since sidecars carry checksums) come all together or not
at all: an older sidecar without them still reads, unverified.
"""

import re

FORMAT = "distloop.tfrecord/1"
INTEGRITY_FIELDS = ("bytes_per_shard", "sha256_per_shard",
                    "fingerprint_per_shard", "generation")
_HEX = {"sha256_per_shard": re.compile(r"[0-9a-f]{64}"),
        "fingerprint_per_shard": re.compile(r"[0-9a-f]{16}")}
_SHARD_NAME = re.compile(r"[\w][\w.+-]*")


def _int(value):
  return isinstance(value, int) and not isinstance(value, bool)


def _short(value):
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _bad(field, value, valid):
  return f"field {field!r} is {_short(value)} ({valid})"


def problems(sidecar, split):
  """The bad fields of `sidecar` (a parsed JSON value), [] if none."""
  if not isinstance(sidecar, dict):
    return [f"the top level is a {type(sidecar).__name__}, not an object "
            "with the fields format, shards, examples_per_shard, ..."]
  out = []
  if sidecar.get("format") != FORMAT:
    out.append(_bad("format", sidecar.get("format"), f"must be {FORMAT!r}"))
  for field in ("shards", "examples_per_shard", "num_examples",
                "image_shape", "label_shape", "class_names"):
    if field not in sidecar:
      out.append(f"field {field!r} is missing")
  for field in ("name", "split"):
    if field in sidecar and not isinstance(sidecar[field], str):
      out.append(_bad(field, sidecar[field], "must be a string"))
  if isinstance(sidecar.get("split"), str) and sidecar["split"] != split:
    out.append(_bad("split", sidecar["split"], f"this is {split}.json"))
  shards = sidecar.get("shards")
  if "shards" in sidecar:
    if (not isinstance(shards, list) or not shards or not all(
        isinstance(s, str) and _SHARD_NAME.fullmatch(s) for s in shards)):
      out.append(_bad("shards", shards, "must be a non-empty list of file "
                      "names in the same folder"))
      shards = None
    elif len(set(shards)) != len(shards):
      out.append(_bad("shards", shards, "names a shard twice"))
  count = len(shards) if isinstance(shards, list) else None
  counts = sidecar.get("examples_per_shard")
  if "examples_per_shard" in sidecar:
    if not isinstance(counts, list) or not all(
        _int(c) and c > 0 for c in counts):
      out.append(_bad("examples_per_shard", counts, "must be a list of "
                      "positive integers, one per shard"))
      counts = None
    elif count is not None and len(counts) != count:
      out.append(_bad("examples_per_shard", counts, f"{len(counts)} counts "
                      f"for {count} shards"))
  if "num_examples" in sidecar:
    total = sidecar["num_examples"]
    if not _int(total) or total <= 0:
      out.append(_bad("num_examples", total, "must be a positive integer"))
    elif isinstance(counts, list) and total != sum(counts):
      out.append(_bad("num_examples", total, "must be the sum of "
                      f"examples_per_shard, {sum(counts)}"))
  image_shape = sidecar.get("image_shape")
  if "image_shape" in sidecar and not (
      isinstance(image_shape, list) and len(image_shape) == 3 and
      all(_int(d) and d > 0 for d in image_shape) and
      image_shape[2] in (1, 3, 4)):
    out.append(_bad("image_shape", image_shape, "must be [H, W, C]: "
                    "positive integers, C 1, 3 or 4"))
    image_shape = None
  label_shape = sidecar.get("label_shape")
  if "label_shape" in sidecar:
    valid = [[]] + ([image_shape[:2]] if image_shape else [])
    if label_shape not in valid:
      out.append(_bad("label_shape", label_shape, "must be [] (a class per "
                      "image) or [H, W] of image_shape (a class per pixel)"))
  names = sidecar.get("class_names")
  if "class_names" in sidecar and not (
      isinstance(names, list) and names and
      all(isinstance(n, str) for n in names)):
    out.append(_bad("class_names", names, "must be a non-empty list of "
                    "strings, one per class"))
  present = [f for f in INTEGRITY_FIELDS if f in sidecar]
  if present and len(present) != len(INTEGRITY_FIELDS):
    missing = [f for f in INTEGRITY_FIELDS if f not in sidecar]
    out.append(f"field {missing[0]!r} is missing (a sidecar with "
               f"{present[0]!r} carries all of {', '.join(INTEGRITY_FIELDS)})")
  for field in ("bytes_per_shard",) + tuple(_HEX):
    if field not in sidecar:
      continue
    values = sidecar[field]
    if field == "bytes_per_shard":
      ok = isinstance(values, list) and all(_int(v) and v > 0 for v in values)
      valid = "must be a list of positive integers, one per shard"
    else:
      ok = isinstance(values, list) and all(
          isinstance(v, str) and _HEX[field].fullmatch(v) for v in values)
      valid = "must be a list of lower-case hex digests, one per shard"
    if not ok:
      out.append(_bad(field, values, valid))
    elif count is not None and len(values) != count:
      out.append(_bad(field, values, f"{len(values)} values for {count} "
                      "shards"))
  if "generation" in sidecar and not (
      isinstance(sidecar["generation"], str) and
      re.fullmatch(r"[0-9a-f]{16}", sidecar["generation"])):
    out.append(_bad("generation", sidecar["generation"], "must be 16 "
                    "lower-case hex digits"))
  return out
