"""The memory CLI and the HLO collective parser."""

import pytest

from jmp_train import memory


def test_cli_table_matches_the_compiled_step(capsys):
  # fp16-true on a 2-D mesh: fp16 params and fp32 masters; the tiny model's
  # dimensions (vocab 96) divide 4, so nothing is padded. (bf16 params on a
  # mesh with a model axis crash the XLA:CPU compiler; see README, Limits.)
  result = memory.main(
    [
      "--model", "tiny-gpt", "--preset", "fp16-true", "--mesh",
      "data=4,model=2", "--check", "--batch", "8",
    ]
  )  # fmt: skip
  out = capsys.readouterr().out
  assert "B/param" in out and "match" in out
  table, n = result["table"], result["n_params"]
  assert table["params"] == 2 * n and table["gradients"] == 2 * n
  assert table["master_weights"] == 4 * n // 4
  assert result["compiled"]["argument"] == result["expected_argument"]


def test_cli_rejects_bad_mesh():
  with pytest.raises(SystemExit, match="--mesh wants name=size"):
    memory.main(["--mesh", "data8"])


def test_collective_parser_on_hlo_lines():
  text = "\n".join(
    [
      "  %rs = f32[4,8]{1,0} reduce-scatter(f32[32,8]{1,0} %g), "
      "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
      "  %ag = bf16[32,8]{1,0} all-gather(bf16[4,8]{1,0} %p), "
      "replica_groups=[1,8]<=[8], dimensions={0}",
      "  %ar = (f32[], f32[]) all-reduce(f32[] %a, f32[] %b), "
      "replica_groups={{0,1,2,3,4,5,6,7}}",
    ]
  )
  found = memory.collective_stats(text, 8)
  kinds = [c.kind for c in found]
  assert kinds == ["reduce-scatter", "all-gather", "all-reduce"]
  rs, ag, ar = found
  assert rs.shape_bytes == 32 * 8 * 4 and rs.bytes == 32 * 8 * 4 * 7 / 8
  assert ag.shape_bytes == 32 * 8 * 2 and ag.group_size == 8
  assert ar.bytes == 2 * 8 * 7 / 8 and ar.max_elements == 1
