"""A preloaded runner for the entry points the tests start as processes (train.py, eval.py,
``python -m models.convert``, tests/init_checkpoint.py): one server process imports torch,
megatron-core, transformers and the entries once; each run is a fresh ``fork`` of it, so a run
pays none of the ~5-8 CPU-s of imports of a ``python train.py`` start and is still a process of
its own: its own process group, signal handlers, globals, exit code, stdout / stderr.

    from tests.runner import launch, run
    proc = run("train.py", CONFIG, "train.steps=4")            # like subprocess.run(capture)
    proc = run("train.py", CONFIG, "parallel.cp=2", nproc=2)   # like torchrun --standalone
    proc = launch("train.py", CONFIG, stdout=PIPE)             # like subprocess.Popen

A run's child does what ``python train.py ARGS`` does after its imports: ``sys.argv``, the cwd
and the environment of the request, stdin / stdout / stderr on the caller's files, then
``sys.exit(main(argv))`` with Python's exit steps (non-daemon threads joined, atexit handlers,
streams flushed) and the exit status of a process (an uncaught exception: traceback, 1; a signal:
minus its number). ``nproc > 1`` starts one child per rank with the environment torchrun gives its
workers (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT of a free port, OMP_NUM_THREADS=1
unless set); when one rank fails the others are stopped, as torchrun does. Only variables read at
run time may differ from the server's environment (``RUN_TIME_ENV``); a run that changes any other
(e.g. ``HF_HOME``, read at import) goes through a plain subprocess instead, so the preload never
changes what a run sees.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL

#: the entries a request may name: script -> (module, function taking argv), or any
#: "module:function"; the function's return value (or SystemExit) is the exit code, as in
#: ``sys.exit(main())``
ENTRIES = {
    "train.py": ("train", "main"),
    "eval.py": ("eval", "main"),
    "-m models.convert": ("models.convert", "main"),
    "tests/init_checkpoint.py": ("tests.init_checkpoint", "main"),
}
#: what the server imports before it forks, in a run's order: the entries (their module-level
#: imports: no megatron-core), then ``models.cpu.activate()`` (what a run does first when it sets
#: up torch.distributed, before megatron-core is imported), then the lazy imports of the runs
ENTRY_MODULES = ("train", "eval", "models.convert", "tests.init_checkpoint")
PRELOAD = (
    "megatron.core", "megatron.core.parallel_state", "megatron.core.dist_checkpointing",
    "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.models.gpt",
    "megatron.core.models.mamba", "transformers", "safetensors.torch",
    "models.checkpointing.checkpoint", "models.convert", "energon_tasks", "energon_tasks.loader",
    "recipes.evaluation",
)
#: environment variables a run may set or change (read when the run uses them, not at import)
RUN_TIME_ENV = frozenset({
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
    "OMP_NUM_THREADS", "VISION_DP_OUT",
    "PYTEST_CURRENT_TEST",  # pytest's per-test bookkeeping
    # set in the test process by what its own tests run (torch's inductor, megatron's model
    # build: NVTE_* attention backend flags), read when used
    "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR",
    "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN",
})


# ------------------------------------------------------------------ server
def _serve(path: str) -> None:
    import importlib

    with warnings.catch_warnings():  # import-time warnings are the server's, not a run's
        warnings.simplefilter("ignore")
        for name in ENTRY_MODULES:
            importlib.import_module(name)
        from models import cpu

        cpu.activate()
        for name in PRELOAD:
            try:  # a module that cannot be preloaded is imported by the run that needs it
                importlib.import_module(name)
            except Exception:
                pass
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    waiting: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)  # EOF: the test session is gone
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)  # nobody reads the server's stdout after this line
    os.close(devnull)
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(data)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for sock in (listener, conn, *waiting.values()):
                        sock.close()
                    for fd in (wake_r, wake_w):
                        os.close(fd)
                    _child(request, fds)  # never returns
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                waiting[pid] = conn
            elif key.fileobj is sys.stdin:
                if not os.read(sys.stdin.fileno(), 1024):
                    for pid in waiting:
                        _kill_quietly(pid, signal.SIGKILL)
                    return
        try:
            while os.read(wake_r, 1024):
                pass
        except BlockingIOError:
            pass
        while waiting:  # reap every finished child, report its exit status
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)})
                              .encode())
                except OSError:
                    pass
                conn.close()


def _kill_quietly(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the requested process, run its entry, exit like Python."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["script"], *request["argv"]]
        import importlib

        import numpy
        import torch

        numpy.random.seed()  # a fresh process's unseeded numpy state, not the server's
        if "OMP_NUM_THREADS" in os.environ:  # libgomp read the server's at import
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        module, function = _entry(request["script"])
        try:
            result = getattr(importlib.import_module(module), function)(request["argv"])
            code = result if isinstance(result, int) else 0
        except SystemExit as done:
            code = _exit_code(done.code)
        except KeyboardInterrupt:
            _finish()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # what the interpreter does with an uncaught error
            sys.excepthook(*sys.exc_info())
            code = 1
        _finish()
    finally:
        os._exit(code)


def _entry(script: str) -> tuple[str, str]:
    """(module, function) of ``script``: one of ``ENTRIES``, or a "module:function" of the tests
    (e.g. a check that must run in a fresh process)."""
    return ENTRIES[script] if script in ENTRIES else tuple(script.split(":"))


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)
    return 1


def _finish() -> None:
    """Python's exit steps: join non-daemon threads, run atexit handlers, flush the streams."""
    try:
        threading._shutdown()
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


# ------------------------------------------------------------------ client
class _Server:
    """The session's server process (started on first use, stopped at exit)."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="runner-")
        self.path = os.path.join(self.folder, "socket")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
        self.env = dict(os.environ)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.runner", self.path],
                                     cwd=REPO, env=env, stdin=PIPE, stdout=PIPE,
                                     start_new_session=True, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"tests/runner.py server did not start ({self.proc.wait()})")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any descendant left behind
        except (ProcessLookupError, PermissionError):
            pass


_server: _Server | None = None
_server_lock = threading.Lock()


def _get_server() -> _Server:
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = _Server()
        return _server


def _open(target, mode: str, kind: str):
    """-> (fd to pass, file the caller reads afterwards or None, fd to close here)."""
    if target is None:  # captured: a temporary file, read at the end
        f = tempfile.TemporaryFile(mode="w+b")
        return f.fileno(), f, None
    if target == PIPE:
        r, w = os.pipe()
        return w, os.fdopen(r if kind == "out" else w, "r"), w
    if target == DEVNULL:
        fd = os.open(os.devnull, os.O_RDWR)
        return fd, None, fd
    return target.fileno(), None, None


class Process:
    """One child of the server (the part of ``subprocess.Popen`` the tests use)."""

    def __init__(self, script: str, argv: list[str], env: dict, cwd: Path, stdout, stderr):
        server = _get_server()
        self.args = [script, *argv]
        self.returncode: int | None = None
        opened = [_open(DEVNULL, "r", "in"), _open(stdout, "w", "out"), _open(stderr, "w", "out")]
        self._files = [f for _, f, _ in opened]
        self.stdout = self._files[1] if stdout == PIPE else None
        self.stderr = self._files[2] if stderr == PIPE else None
        request = {"script": script, "argv": argv, "env": env, "cwd": str(cwd)}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._conn.connect(server.path)
        try:
            socket.send_fds(self._conn, [json.dumps(request).encode()],
                            [fd for fd, _, _ in opened])
        finally:
            for _, _, mine in opened:
                if mine is not None:
                    os.close(mine)
        self.pid = json.loads(self._conn.recv(1 << 16))["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_status(timeout=0)
        return self.returncode

    def _read_status(self, timeout: float | None) -> bool:
        """The exit status from the server, waiting up to ``timeout`` s (None: until it comes)."""
        self._conn.settimeout(timeout)
        try:
            data = self._conn.recv(1 << 16)
        except (BlockingIOError, TimeoutError):
            return False
        # no message: the server is gone (it kills its children when the session ends)
        self.returncode = json.loads(data)["returncode"] if data else -signal.SIGKILL
        self._conn.close()
        return True

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            _kill_quietly(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """What the child wrote to captured stdout / stderr (after it exited)."""
        texts = []
        for f in self._files[1:]:
            if f is None or f in (self.stdout, self.stderr):
                texts.append(None)
                continue
            f.seek(0)
            texts.append(f.read().decode(errors="replace"))
            f.close()
        return texts[0], texts[1]


class Group:
    """The ranks of one ``nproc > 1`` launch, waited for together as torchrun does."""

    def __init__(self, procs: list[Process]):
        self.procs = procs
        self.args = procs[0].args
        self.pid = procs[0].pid
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                if failed:  # torchrun stops the other workers
                    for p in self.procs:
                        p.send_signal(signal.SIGTERM)
                    for p in self.procs:
                        try:
                            p.wait(timeout=30)
                        except subprocess.TimeoutExpired:
                            p.kill()
                            p.wait()
                self.returncode = failed[0] if failed else 0
                break
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for p in self.procs:
            p.send_signal(sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        outs = [p.output() for p in self.procs]
        return ("".join(o or "" for o, _ in outs), "".join(e or "" for _, e in outs))


def _can_fork() -> bool:
    """A CPU-only torch build: no CUDA runtime a forked child could inherit half-initialised."""
    import torch

    return torch.version.cuda is None and getattr(torch.version, "hip", None) is None


#: MASTER_PORTs of multi-rank runs: below the kernel's ephemeral range (32768-60999 here: no
#: connection is given a local port there) and below slurm/train.sbatch's 20000 + job id, in a
#: block of its own per pytest-xdist worker, so that another worker's run never takes a port
#: between its check here and rank 0's bind (a port 0 from the kernel could: EADDRINUSE, seen)
PORT_BASE, PORT_BLOCK, PORT_BLOCKS = 10000, 1500, 6
_ports_used = 0


def _free_port() -> int:
    global _ports_used
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = PORT_BASE + (int(worker) % PORT_BLOCKS if worker.isdigit() else 0) * PORT_BLOCK
    for _ in range(PORT_BLOCK):
        port = base + _ports_used % PORT_BLOCK
        _ports_used += 1
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}..{base + PORT_BLOCK - 1}")


def launch(script: str, *args: str, nproc: int = 1, env: dict | None = None,
           cwd: Path = REPO, stdout=None, stderr=None, plain: bool = False):
    """Start ``script args`` (one of ``ENTRIES``) as a child of the server, or ``nproc`` ranks of
    it; returns a Popen-like ``Process`` / ``Group`` (stdout / stderr: None to capture, PIPE,
    DEVNULL or a file). A plain subprocess instead (``python script`` / ``torchrun
    --standalone``) with ``plain``, or when ``env`` changes anything outside ``RUN_TIME_ENV``."""
    argv = [str(a) for a in args]
    full = {**os.environ, **(env or {})}
    if not plain and not _can_fork():
        plain = True
    if not plain:
        server_env = _get_server().env
        changed = {k for k in set(full) | set(server_env) if full.get(k) != server_env.get(k)}
        if changed - RUN_TIME_ENV:
            warnings.warn(f"tests/runner.py: {script} as a plain subprocess (the environment "
                          f"differs from the server's in {sorted(changed - RUN_TIME_ENV)})",
                          stacklevel=2)
            plain = True
    if plain:
        return _Plain(script, argv, nproc, full, cwd, stdout, stderr)
    if nproc == 1:
        return Process(script, argv, full, cwd, stdout, stderr)
    port = _free_port()
    ranks = []
    for rank in range(nproc):
        rank_env = {"OMP_NUM_THREADS": "1", **full, "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                    "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc),
                    "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "runner"}
        ranks.append(Process(script, argv, rank_env, cwd, stdout, stderr))
    return Group(ranks)


class _Plain:
    """The subprocess fallback of ``launch`` (same interface)."""

    def __init__(self, script, argv, nproc, env, cwd, stdout, stderr):
        if script not in ENTRIES:  # "module:function"
            module, function = _entry(script)
            script = (f"-c import sys, {module}; sys.exit({module}.{function}(sys.argv[1:]))")
            script = script.split(" ", 1)
        else:
            script = script.split()
        cmd = [sys.executable, *script] if nproc == 1 else [  # the project's torchrun
            sys.executable, "-m", "recipes.launch", "--standalone",
            "--nproc-per-node", str(nproc), *script]
        self._out = [tempfile.TemporaryFile() if s is None else None for s in (stdout, stderr)]
        self._proc = subprocess.Popen(
            [*cmd, *argv], cwd=cwd, env=env, stdin=DEVNULL, text=True,
            stdout=self._out[0] or stdout, stderr=self._out[1] or stderr)
        self.args, self.pid = self._proc.args, self._proc.pid
        self.stdout, self.stderr = self._proc.stdout, self._proc.stderr

    @property
    def returncode(self):
        return self._proc.returncode

    def poll(self):
        return self._proc.poll()

    def wait(self, timeout=None):
        return self._proc.wait(timeout)

    def send_signal(self, sig):
        self._proc.send_signal(sig)

    def kill(self):
        self._proc.kill()

    def output(self):
        texts = []
        for f in self._out:
            if f is None:
                texts.append(None)
            else:
                f.seek(0)
                texts.append(f.read().decode(errors="replace"))
                f.close()
        return texts[0], texts[1]


def run(script: str, *args: str, nproc: int = 1, env: dict | None = None, cwd: Path = REPO,
        timeout: float | None = None, plain: bool = False) -> subprocess.CompletedProcess:
    """``launch`` and wait: like ``subprocess.run(capture_output=True, text=True)`` (killed on
    ``timeout``, then ``TimeoutExpired``)."""
    proc = launch(script, *args, nproc=nproc, env=env, cwd=cwd, plain=plain)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    out, err = proc.output()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out or "", err or "")


if __name__ == "__main__":
    _serve(sys.argv[1])
