"""`python -m ds_ppo ARGS` without paying the imports each time: a server process imports torch,
transformers, DeepSpeed and ds_ppo once (as `ds-ppo` would, in the same order, with the same
environment) and forks one child per command. The child is a process of its own (its own exit
code, stdout, stderr, working directory, signals and interpreter state), started in
milliseconds instead of the 4-7 s of imports.

What a fork does not give: import-time behaviour (library notices printed while importing, which
modules a command imports, start-up time) and environment variables read at import. Tests of
those start a fresh interpreter (`run_cli(..., fresh=True)`), as do commands run with an
environment other than the server's.

Protocol (one command at a time, over the server's stdin/stdout): a JSON line
{"args", "cwd", "env", "out", "err"} in; a line with the child's pid, then one with its exit
status, out. The child writes its stdout and stderr to the files `out` and `err`.
"""
from __future__ import annotations

import json
import os
import sys


def _child(req: dict) -> int:
    """Runs in the forked child: `ds-ppo ARGS` as `python -m ds_ppo` runs it."""
    os.setsid()  # its own process group: a timeout kills what it started too
    os.chdir(req["cwd"])
    sys.path[0] = os.getcwd()  # as `python -m` puts the starting directory first
    os.environ.clear()
    os.environ.update(req["env"])
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = [sys.argv[0], *req["args"]]
    try:
        from ds_ppo.cli import main

        code = main(req["args"])
    except SystemExit as e:  # as the interpreter reports sys.exit(...)
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # an uncaught exception: the traceback and 1, as python does
        import traceback

        traceback.print_exc()
        code = 1
    import atexit
    import logging

    logging.shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    return code if isinstance(code, int) else 0


def serve() -> None:
    # what `ds-ppo` does before it imports anything heavy (cli.main), then the imports
    from ds_ppo.run.log_setup import quiet_notices

    quiet_notices("info")
    from ds_ppo.run.tracking import quiet_mlflow

    quiet_mlflow()
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from ds_ppo.engine.dist import import_deepspeed

    import_deepspeed()
    import ds_ppo.cli  # noqa: F401
    import ds_ppo.trainer  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import peft  # noqa: F401  (LoRA)
    import torch.utils.cpp_extension  # noqa: F401  (the extension cache's lock check)

    proto_out = os.fdopen(os.dup(1), "w", buffering=1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)  # nothing the server itself prints reaches the protocol
    proto_out.write("ready\n")
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            proto_out.close()
            os._exit(_child(req) & 0xFF)
        proto_out.write(f"{pid}\n")
        _, status = os.waitpid(pid, 0)
        proto_out.write(f"{os.waitstatus_to_exitcode(status)}\n")


if __name__ == "__main__":
    serve()
