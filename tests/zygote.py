"""Ray worker processes for the test session, forked from one process that has imported torch,
transformers, vLLM and rlframe's workers once.

Every end-to-end test starts worker groups, and each of their Ray worker processes would import
the same 3-6 s of modules again (on 2 cores, most of a short run's start-up). A Ray started with
`runtime_env={"py_executable": client_command(...)}` (the session's, and the runs the tests launch
as subprocesses with `job_env(...)`) runs this file's client where it would run Python
(`python -S zygote.py client SOCKET default_worker.py ARGS...`); the client hands its argv,
environment, working directory and standard streams to the server, which forks a child that becomes
the worker (`runpy` of default_worker.py, as `python default_worker.py ARGS` would run it). Each
worker is still a fresh process with no state of an earlier one: only imports are shared, and Ray
itself is not among them (its core reads the job id, the raylet and the auth token once per
process), so a worker of any job or cluster on this machine can fork from the same server. The
client lives as long as its worker and exits with its status, so Ray sees the process it started
behave as the worker does; a client killed takes its worker with it.

The server is single-threaded (forking a process with threads is unsafe): one select loop over the
listening socket and the clients, reaping children as they exit.
"""

from __future__ import annotations

import array
import json
import os
import select
import signal
import socket
import struct
import sys

# Everything a worker imports except Ray and the vLLM modules that import it (vllm.entrypoints.llm
# and its engine client, about 0.3 s on top of these).
PRELOAD = ("torch", "torch.distributed", "transformers", "safetensors.torch", "tensordict",
           "rlframe.single_controller.host", "rlframe.workers.actor", "rlframe.workers.critic", "rlframe.workers.generator",
           "rlframe.workers.reference", "rlframe.workers.reward_model", "rlframe.workers.rollout.vllm_engine",
           "rlframe.workers.rollout.hf_engine", "rlframe.workers.engines.fsdp.engine", "vllm", "vllm.config",
           "vllm.engine.arg_utils", "vllm.sampling_params", "vllm.model_executor.models.qwen2",
           "vllm.model_executor.layers.linear", "vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu_worker",
           "vllm.v1.attention.backends.cpu_attn", "vllm.v1.core.sched.scheduler", "vllm.tokenizers",
           "megatron.core", "rlframe.workers.engines.megatron.engine")


def _send_frame(sock: socket.socket, data: bytes, fds=()) -> None:
    msg = [struct.pack("!I", len(data)) + data]
    if fds:
        sock.sendmsg(msg, [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(msg[0])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError
        out += chunk
    return out


def client(socket_path: str, argv: list[str]) -> int:
    """Run `python ARGV` in a child of the server; return its exit status."""
    import time

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 120
    while True:  # the server may still be importing
        try:
            sock.connect(socket_path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    request = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    _send_frame(sock, json.dumps(request).encode(), fds=(0, 1, 2))
    (pid,) = struct.unpack("!i", _recv_exact(sock, 4))

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    while True:
        try:
            (status,) = struct.unpack("!i", _recv_exact(sock, 4))
            return status
        except InterruptedError:
            continue
        except EOFError:
            return 1


def _become_worker(request: dict, fds: list[int], listener: socket.socket, conns, *, warm: bool) -> None:
    """In the forked child: take the client's streams, environment and argv, and run the script
    (in this process when `warm`, else in a fresh interpreter exec'd in its place)."""
    import atexit
    import runpy

    os.setpgid(0, 0)  # its own process group, as Ray's workers are (Ray signals a worker's group)
    listener.close()
    for c in conns:
        c.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script, *args = request["argv"]
    if not warm:
        os.execv(sys.executable, [sys.executable, script, *args])
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _preload() -> bool:
    """Import PRELOAD; False (every worker then gets a fresh interpreter) if Ray came in with it."""
    import importlib
    import warnings

    for module in PRELOAD:
        try:
            with warnings.catch_warnings():  # megatron-core's notes on optional packages: once per worker, not here
                warnings.simplefilter("ignore")
                importlib.import_module(module)
        except Exception as e:  # an optional backend not installed: its workers import it themselves
            print(f"zygote: not preloaded {module}: {e}", file=sys.stderr)
    if "ray" in sys.modules:
        print("zygote: a preloaded module imported Ray; workers start as fresh interpreters", file=sys.stderr)
        return False
    return True


def serve(socket_path: str) -> None:
    warm = _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path + ".tmp")
    os.rename(socket_path + ".tmp", socket_path)  # clients connect once it is listening
    listener.listen(64)
    children: dict[int, socket.socket] = {}  # worker pid -> its client's connection
    by_conn: dict[socket.socket, int] = {}
    parent = os.getppid()
    while os.getppid() == parent:  # the session that started it is gone: so are its workers' users
        readable, _, _ = select.select([listener, *by_conn], [], [], 0.2)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                # the descriptors come with the frame's first bytes: read the header with them
                header, ancdata, _, _ = conn.recvmsg(4, socket.CMSG_SPACE(3 * 4))
                header += _recv_exact(conn, 4 - len(header))
                size = struct.unpack("!I", header)[0]
                data = _recv_exact(conn, size)
                fds = array.array("i")
                for level, kind, payload in ancdata:
                    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                        fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                request = json.loads(data)
                pid = os.fork()
                if pid == 0:
                    _become_worker(request, list(fds), listener, list(by_conn), warm=warm)
                for fd in fds:
                    os.close(fd)
                conn.sendall(struct.pack("!i", pid))
                children[pid], by_conn[conn] = conn, pid
            else:  # a client closed its end (killed): its worker goes too
                try:
                    gone = not sock.recv(1)
                except OSError:
                    gone = True
                if gone:
                    try:
                        os.kill(by_conn[sock], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                by_conn.pop(conn, None)
                try:
                    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status) & 0xFF))
                except OSError:
                    pass
                conn.close()


def client_command(socket_path: str) -> str:
    """The `py_executable` that makes Ray start its workers through the server at `socket_path`."""
    return f"{sys.executable} -S {os.path.abspath(__file__)} client {socket_path}"


def job_env(socket_path: str) -> dict[str, str]:
    """Environment for a driver launched as a subprocess (`python -m rlframe.main ...`): the Ray it
    starts runs its workers through the server too (Ray merges this job config into the driver's)."""
    return {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": {"py_executable": client_command(socket_path)}})}


if __name__ == "__main__":
    if sys.argv[1] == "client":
        sys.exit(client(sys.argv[2], sys.argv[3:]))
    serve(sys.argv[2])
