"""The sandboxed child of :func:`megaforge.rollout.sandbox.run_code` (standard library only).

    python -I _sandbox_child.py main.py MEMORY_BYTES CPU_SECONDS FILE_BYTES

Applies the limits (in this order: network namespace, resource limits, drop root, audit hook), then
runs ``main.py`` from the working directory as ``__main__``.
"""
import os
import resource
import sys

NOBODY = 65534
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
BLOCKED = {
    "socket.__new__", "socket.socketpair", "socket.fromfd", "subprocess.Popen", "os.system", "os.exec",
    "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.startfile", "pty.spawn", "ctypes.dlopen",
    "ctypes.dlsym", "ctypes.cdata", "ctypes.call_function", "resource.setrlimit", "resource.prlimit",
    "os.killpg", "os.setuid", "os.setgid", "os.chroot",
}
PATH_EVENTS = {"os.remove", "os.rmdir", "os.rename", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
               "os.truncate", "shutil.rmtree", "shutil.move", "shutil.copyfile", "os.utime"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _unshare(flags: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).unshare(flags) == 0
    except Exception:  # noqa: BLE001
        return False


def _new_netns() -> bool:
    """Move into a new (empty) network namespace when the kernel allows it: directly as root, else
    (after dropping root) inside a new user namespace."""
    if os.getuid() == 0 and _unshare(CLONE_NEWNET):
        return True
    _drop_root()
    return _unshare(CLONE_NEWUSER | CLONE_NEWNET)


def _limits(mem: int, cpu: int, fsize: int) -> None:
    for what, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_FSIZE, fsize),
                    (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
        resource.setrlimit(what, (v, v))


def _world_traversable(path: str) -> bool:
    """Whether a user other than the owner can reach ``path`` (every parent directory has o+x)."""
    import stat

    path = os.path.realpath(path)
    while True:
        try:
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _drop_root() -> None:
    """root -> nobody, when nobody can still load the interpreter's standard library (a Python
    installed under /root cannot be: the child then stays root, with every other limit applied)."""
    import sysconfig

    if os.getuid() == 0 and all(_world_traversable(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib")):
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def _install_hook(root: str) -> None:
    def inside(path) -> bool:
        if isinstance(path, int):
            return True
        try:
            p = os.path.realpath(os.fsdecode(path))
        except Exception:  # noqa: BLE001
            return False
        return p == root or p.startswith(root + os.sep)

    def hook(event, args):
        if event in BLOCKED:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "os.kill" and args and args[0] not in (0, os.getpid()):
            raise PermissionError("sandbox: signals to other processes are not allowed")
        if event == "open" and args:
            path, mode, flags = (list(args) + [None, None])[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                      (isinstance(flags, int) and flags & WRITE_FLAGS)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory is not allowed")
        if event in PATH_EVENTS and args and not all(inside(a) for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))):
            raise PermissionError(f"sandbox: {event} outside the sandbox directory is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    script, mem, cpu, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    root = os.path.realpath(os.getcwd())
    netns = _new_netns()
    _drop_root()
    _limits(mem, cpu, fsize)
    os.environ["MEGAFORGE_SANDBOX_NETNS"] = str(int(netns))
    with open(script) as f:
        source = f.read()
    code = compile(source, script, "exec")
    sys.argv = [script]
    sys.path[:0] = [root]
    _install_hook(root)
    exec(code, {"__name__": "__main__", "__file__": script, "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
