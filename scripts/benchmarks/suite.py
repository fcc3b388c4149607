"""The CIFAR-10 CNN benchmarks in one run: fit vs Trainer, variants, breakdown.

    python scripts/benchmarks/suite.py --quick --output_json=/tmp/bench.json

Runs `fit_vs_trainer.py` (each of --strategies), `variants.py` and
`breakdown.py` (the first strategy), each measurement in its own process as
those scripts do, then prints their tables and writes one JSON with the keys
`compare`, `variants`, `breakdown` and `flags`. Every flag of the three
scripts works here. Timings are noisy on a shared machine: compare the
ratios, not the absolutes.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

from scripts.benchmarks import breakdown  # pylint: disable=g-import-not-at-top
from scripts.benchmarks import common
from scripts.benchmarks import fit_vs_trainer
from scripts.benchmarks import variants

FLAGS = flags.FLAGS
flags.DEFINE_bool("breakdown", True, "Also time the stages of a step "
                  "(input, forward, backward, full step).")


def main(argv):
  del argv
  common.apply_quick()
  compare = fit_vs_trainer.run()
  variant_rows = variants.run()
  step_breakdown = breakdown.run() if FLAGS.breakdown else None
  fit_vs_trainer.report(compare)
  variants.report(variant_rows)
  if step_breakdown:
    breakdown.report(step_breakdown)
  if FLAGS.output_json:
    common.write_json(FLAGS.output_json, {
        "compare": compare, "variants": variant_rows,
        "breakdown": step_breakdown,
        "flags": {k: FLAGS[k].value for k in (
            "quick", "global_batch_size", "steps_per_loop",
            "memory_batch_size", "loops_per_round", "rounds", "xla",
            "data_dir")}}, indent=2)


if __name__ == "__main__":
  app.run(main)
