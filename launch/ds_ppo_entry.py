"""Rank entry point for launchers that start every rank directly (the deepspeed runner's
`--launcher openmpi` and `--launcher slurm`), instead of through DeepSpeed's per-node
launcher, which is what sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.

    ds_ppo_entry.py --master-addr ADDR --master-port PORT [--module ds_ppo] train ARGS...

sets those variables from OpenMPI's (OMPI_COMM_WORLD_*), MPICH/Intel MPI's (PMI_*) or SLURM's
(SLURM_PROCID, ...) variables, then runs the module as `python -m` would. Variables that are
already set are left alone. The mapping itself is `ds_ppo.engine.dist.launcher_rank_vars`,
the one the trainer applies too.
"""
from __future__ import annotations

import os
import runpy
import sys

def rank_env(environ: dict[str, str], master_addr: str, master_port: int) -> dict[str, str]:
    """The torch.distributed variables this rank lacks, derived from its launcher's."""
    from ds_ppo.engine.dist import launcher_rank_vars

    out = launcher_rank_vars(environ)
    if "RANK" not in environ and not out:
        raise SystemExit("ds_ppo_entry.py: no RANK and no OpenMPI/PMI/SLURM rank variables: "
                         "start it through `deepspeed --launcher openmpi|slurm`")
    out.setdefault("MASTER_ADDR", environ.get("MASTER_ADDR", master_addr))
    out.setdefault("MASTER_PORT", environ.get("MASTER_PORT", str(master_port)))
    return out


def main(argv: list[str]) -> None:
    # Only the leading options are ours; everything after them belongs to the module.
    opts = {"--master-addr": None, "--master-port": "29500", "--module": "ds_ppo"}
    while argv and argv[0] in opts:
        if len(argv) < 2:
            raise SystemExit(f"ds_ppo_entry.py: {argv[0]} needs a value")
        opts[argv[0]], argv = argv[1], argv[2:]
    if opts["--master-addr"] is None:
        raise SystemExit("ds_ppo_entry.py: --master-addr is required")
    sys.path[0] = os.getcwd()  # as `python -m` has it, instead of this script's directory
    os.environ.update(rank_env(dict(os.environ), opts["--master-addr"], int(opts["--master-port"])))
    sys.argv = [opts["--module"], *argv]
    runpy.run_module(opts["--module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
