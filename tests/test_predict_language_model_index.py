"""predict.py --index (or --image) on a language model's run is one line
pointing to --prompt, not a message about per-pixel labels."""

import framework
from framework.app import experiment
from tests.helpers import assert_one_line_error, run_script, snapshot
from tests.test_text_dataset import write_corpus


def test_index_on_a_gpt_run_points_to_prompt(tmp_path):
  write_corpus(str(tmp_path / "corpus"), num_files=4)
  config = framework.ExperimentConfig(
      model="gpt", dataset="text", data_dir=str(tmp_path / "corpus"),
      model_dir=str(tmp_path / "run"), global_batch_size=4, train_steps=1,
      export_saved_model=False,
      model_options=dict(num_layers=1, num_heads=2, model_width=8),
      dataset_options=dict(sequence_length=8),
      loop=framework.LoopConfig(train_steps=1, steps_per_loop=1,
                                summary_every=0, log_every=0))
  experiment.run(config)
  before = snapshot(config.model_dir)
  proc = run_script("predict.py", f"--model_dir={config.model_dir}",
                    "--index=0", check=False)
  assert_one_line_error(proc, "predict.py", "a language model", "--prompt",
                        unchanged=before)
