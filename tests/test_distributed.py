"""jmp_train.distributed in one process: finding the launcher, the local
launcher's command line, and the global batch. (Two processes:
test_multiprocess.py.)"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

from jmp_train import distributed, train, zero1


@pytest.mark.parametrize(
  "environ, found",
  [
    ({}, ""),
    ({"JMP_TRAIN_PROCESS_ID": "1"}, "jmp_train.launch"),
    ({"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"}, "explicit"),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "16"}, "slurm"),
    # A shell inside an allocation (no step), or a one-task step: alone.
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, ""),
    ({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "1"}, ""),
    (
      {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_MCA_orte_hnp_uri": "1.2:tcp://x"},
      "open-mpi",
    ),
    ({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_MCA_orte_hnp_uri": "1.2:tcp://x"}, ""),
    # Open MPI 5 (PRRTE) sets no ORTE URI, which JAX reads: not detected.
    ({"OMPI_COMM_WORLD_SIZE": "4"}, ""),
    (
      {"JOB_COMPLETION_INDEX": "3", "KUBERNETES_SERVICE_HOST": "10.0.0.2"},
      "kubernetes",
    ),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.2"}, ""),  # a pod, not a JobSet
    ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, "cloud-tpu"),
    ({"TPU_WORKER_HOSTNAMES": "t0"}, ""),  # one host
  ],
)
def test_cluster_in_environment(environ, found):
  assert distributed.cluster_in_environment(environ) == found


def test_initialize_alone_does_nothing():
  assert not jax.distributed.is_initialized()
  if distributed.cluster_in_environment():
    pytest.skip("this test session itself runs under a cluster launcher")
  assert distributed.initialize() is False
  assert distributed.process_prefix() == ""
  # One process: nothing to compare with, nothing gathered.
  distributed.check_same_on_every_process({"w": np.ones(3)}, "params")
  with pytest.raises(TypeError, match="force must be True or False"):
    distributed.initialize(force=1)


def test_initialize_under_launch_with_one_process_stays_alone(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
  monkeypatch.setenv("JMP_TRAIN_NUM_PROCESSES", "1")
  monkeypatch.setenv("JMP_TRAIN_PROCESS_ID", "0")
  assert distributed.cluster_in_environment() == "jmp_train.launch"
  assert distributed.initialize() is False
  assert not jax.distributed.is_initialized()
  # Processes it starts are not part of a launched run.
  assert distributed.cluster_in_environment() == ""


def test_a_launched_process_that_never_joined_is_refused(monkeypatch):
  # `launch -n 2` of a script without initialize(): each process would
  # train alone, as a separate run, beside the other.
  monkeypatch.setenv("JMP_TRAIN_NUM_PROCESSES", "2")
  monkeypatch.setenv("JMP_TRAIN_PROCESS_ID", "1")
  tx = optax.sgd(0.1)
  with pytest.raises(RuntimeError, match="process 1 of 2, but it never join"):
    train.TrainState.create(params={"w": jnp.ones(2)}, tx=tx)
  with pytest.raises(RuntimeError, match="never joined"):
    train.make_train_step(lambda p, b, s, k: jnp.sum(p["w"]), tx)
  monkeypatch.setenv("JMP_TRAIN_NUM_PROCESSES", "1")  # launch -n 1
  train.TrainState.create(params={"w": jnp.ones(2)}, tx=tx)


def test_launch_command_line_prefixes_each_process(tmp_path):
  script = tmp_path / "hello.py"
  script.write_text(
    "import os, sys\n"
    "print('id', os.environ['JMP_TRAIN_PROCESS_ID'],"
    " os.environ['JMP_TRAIN_NUM_PROCESSES'],"
    " os.environ['JAX_COORDINATOR_ADDRESS'].split(':')[0], sys.argv[1:])\n"
  )
  out = subprocess.run(
    [sys.executable, "-m", "jmp_train.launch", "-n", "2", str(script), "--x"],
    capture_output=True,
    text=True,
    timeout=60,
    check=True,
  ).stdout
  lines = sorted(out.splitlines())
  assert lines == [
    "[0] id 0 2 127.0.0.1 ['--x']",
    "[1] id 1 2 127.0.0.1 ['--x']",
  ]


def test_launch_refuses_bad_arguments():
  with pytest.raises(ValueError, match="argv must be a non-empty list"):
    distributed.launch("train.py", 2)
  with pytest.raises(ValueError, match="num_processes"):
    distributed.launch(["train.py"], 0)
  with pytest.raises(ValueError, match="timeout_s must be a positive"):
    distributed.launch(["train.py"], 2, timeout_s="5")


def test_initialize_names_what_an_explicit_coordinator_lacks(monkeypatch):
  monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
  monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
  monkeypatch.setenv("JAX_PROCESS_ID", "0")
  with pytest.raises(RuntimeError, match=r"\['JAX_NUM_PROCESSES'\] are not"):
    distributed.initialize()
  assert not jax.distributed.is_initialized()


def _plan(n=8):
  tx = optax.sgd(0.1)
  mesh = jax.make_mesh(
    (n,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n]
  )
  return zero1.make_plan(tx, {"w": jnp.ones(3)}, mesh)


def test_global_batch_in_one_process_is_the_whole_batch():
  plan = _plan()
  rows = {"x": np.arange(32.0).reshape(16, 2), "y": np.arange(16)}
  batch = train.global_batch(rows, plan)
  assert batch["x"].sharding == plan.batch_sharding
  np.testing.assert_array_equal(batch["x"], rows["x"])
  np.testing.assert_array_equal(batch["y"], rows["y"])
  # Each device holds its 2 rows, in order.
  shard = batch["x"].addressable_shards[3]
  np.testing.assert_array_equal(shard.data, rows["x"][6:8])
  # Without a plan: the batch as JAX arrays.
  plain = train.global_batch(rows)
  assert isinstance(plain["x"], jax.Array)
  np.testing.assert_array_equal(plain["x"], rows["x"])


def test_global_batch_refuses_rows_that_do_not_split():
  with pytest.raises(ValueError, match=r"'x' has shape \(12, 2\).*8 positions"):
    train.global_batch({"x": np.zeros((12, 2))}, _plan())
  with pytest.raises(ValueError, match=r"'s' has shape \(\)"):
    train.global_batch({"s": np.float32(1.0)}, _plan())
