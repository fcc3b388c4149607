"""scripts/benchmarks/memory_table.py --check: the bytes each device holds
(weights, gradients, optimizer slots), counted from the trainers of data
parallel, ZeRO-1, ZeRO-2 and ZeRO-3 on 2 mirrored replicas, equal the counts by
hand from the parameter count."""

import json

import pytest

import helpers


@pytest.mark.slow  # traces 3 GPT steps on 2 replicas: 20-90 s
def test_counted_bytes_per_device_equal_the_counts_by_hand(tmp_path):
  path = tmp_path / "check.json"
  proc = helpers.run_script("benchmarks/memory_table.py", "--check",
                            f"--json={path}", timeout=300, check=False)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
  assert "counted = by hand for every row" in proc.stdout
  rows = {r["config"]: r for r in json.loads(path.read_text())["rows"]}
  # The tiny GPT: 7,664 float32 parameters (each sharded variable padded
  # to a multiple of 2: the same 7,664 here, all sizes even).
  p = 7664
  expected = {"data parallel": (4 * p, 4 * p, 8 * p),
              "ZeRO-1": (4 * p, 4 * p, 4 * p),
              "ZeRO-2": (4 * p, 2 * p, 4 * p),
              # Its weights at rest: the shards (the host's whole copy is
              # outside the replicas).
              "ZeRO-3": (2 * p, 2 * p, 4 * p)}
  for config, sizes in expected.items():
    row = rows[config]
    assert row["status"] == "measured" and row["P"] == p
    for kind, size in zip(("weights", "gradients", "slots"), sizes):
      assert row["by_hand"][kind] == size, (config, kind)
      # Both replicas' devices, each holding exactly that.
      assert sorted(row["per_device"][kind].values()) == [size, size], (
          config, kind, row["per_device"][kind])
