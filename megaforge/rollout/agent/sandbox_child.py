"""The sandboxed side of :func:`megaforge.rollout.agent.sandbox.run_code` (standard library only).

    python -I sandbox_child.py '{"script": ..., "status_fd": ..., "ctl_fd": ..., limits...}'

Three processes (the kernel is the boundary; nothing here relies on the code's good will):

* **S** (this script, started by the trainer): opens the directories the interpreter needs, clears
  its supplementary groups (as root), then ``unshare(user, mount, pid, net, ipc)`` and waits while
  the trainer writes its uid/gid maps (one unprivileged uid, see ``sandbox.py``). It then switches
  to that uid, remounts every mount read-only (plus ``nosuid,nodev``), hides ``/root``, ``/home``,
  the trainer's home and whatever blocks the interpreter behind empty tmpfs (binding the
  interpreter's directories back, read-only), mounts a private size-limited tmpfs on ``/tmp`` (the
  only writable place: the code's directory) and empty read-only ones on ``/dev/shm``,
  ``/var/tmp``, ``/run/lock``; forks **P1** and kills it at the deadline. P1 is PID 1 of the new
  PID namespace: when it dies the kernel kills every process left in the namespace, and
  ``waitpid`` returns only once they are all gone, so nothing the code started outlives the call.
* **P1**: mounts its own ``/proc`` (only the namespace's processes), drops every capability
  (bounding set, ambient, effective/permitted/inheritable) and sets ``no_new_privs`` (no setuid
  binary can lift it), installs a seccomp filter that refuses (EPERM) the memory ``RLIMIT_AS`` does
  not count: SysV shared memory, message queues and semaphores (a detached ``shmget`` segment is
  held by the kernel, not the process) and ``memfd_create``/``memfd_secret`` (a memfd's pages stay
  while its descriptor is open, unmapped); syscalls of another ABI (i386, x32) are refused too.
  It checks all three (``CapEff`` 0, ``Seccomp`` 2, every visible mount read-only except ``/tmp``;
  interpreter folders under ``/tmp``, as a virtualenv in a CI clone, are bound back read-only),
  applies the resource limits (``RLIMIT_NPROC`` binds: the uid is not root) and ``execve``'s a fresh
  ``python -I main.py`` in ``/tmp``.

So what the code can hold is ``memory_mb`` (RLIMIT_AS) plus ``scratch_mb`` (the /tmp tmpfs);
``/dev/shm`` is an empty read-only tmpfs. The seccomp filter needs this machine's syscall numbers:
x86_64 and aarch64 (any other architecture is a set-up error, nothing runs).

Status lines go to the trainer on ``status_fd``: ``unshared``, ``ready <description>``,
``error <message>`` (set-up failed, or the interpreter could not be started: the code did not run),
``exit <wait status> <timed out 0|1>``.
"""
import ctypes
import errno
import json
import os
import resource
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
# Its own prctl (death signal included), not megaforge.supervise's: this file runs as `python -I <this file>`
# (isolated mode: no PYTHONPATH, no site) from an emptied environment, so it cannot import megaforge.
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 24, 38, 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522
HIDDEN_EMPTY = ("/dev/shm", "/var/tmp", "/run/lock")  # world-writable on most systems: hidden, read-only
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
# Syscalls refused (EPERM) in the sandbox: memory the kernel holds outside RLIMIT_AS. Per architecture:
# (AUDIT_ARCH, first number of another ABI sharing it (x32) or None, {name: number}).
_IPC = ("shmget", "shmat", "shmctl", "shmdt", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop",
        "semctl", "semtimedop", "memfd_create", "memfd_secret")
SECCOMP_DENY = {
    "x86_64": (0xC000003E, 0x40000000, dict(zip(_IPC, (29, 30, 31, 67, 68, 69, 70, 71, 64, 65, 66, 220, 319, 447)))),
    "aarch64": (0xC00000B7, None, dict(zip(_IPC, (194, 196, 195, 197, 186, 189, 188, 187, 190, 193, 191, 192, 279,
                                                  447)))),
}
SETUP_FAILED = 70

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


class SetupError(Exception):
    pass


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(e)} (errno {e})")


def _mount(src, target: str, fstype, flags: int, data: str = "") -> None:
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    kind = fstype or ("bind" if flags & MS_BIND and not flags & MS_REMOUNT else "remount")
    _check(_libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data) if data else None), f"mount {target} ({kind})")


def _prctl(*args: int) -> int:
    return _libc.prctl(*[ctypes.c_ulong(a) for a in args])


def _unescape(path: str) -> str:
    """Mount points in mountinfo escape space, tab, newline and backslash as octal."""
    return path.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "surrogateescape")


def _mounts() -> list[tuple[str, set]]:
    """(mount point, per-mount options) of every mount this process sees, parents first."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            out.append((_unescape(parts[4]), set(parts[5].split(","))))
    return out


def _remount_all_readonly() -> None:
    """Every mount read-only, nosuid, nodev except ``/dev`` itself (``/dev/null`` stays usable;
    the uid opens only world-accessible devices); noexec and atime flags kept (a user namespace may
    not clear flags the parent namespace locked)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for point, opts in _mounts():
        nodev = MS_NODEV if point != "/dev" or "nodev" in opts else 0
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | nodev | (MS_NOEXEC if "noexec" in opts else 0)
        if _libc.mount(None, os.fsencode(point), None, flags, None) != 0:
            e = ctypes.get_errno()
            if e in (2, 13, 20):  # ENOENT, EACCES, ENOTDIR: a mount point this uid cannot reach by its path
                continue
            raise SetupError(f"remounting {point} read-only: {os.strerror(e)} (errno {e})")


def _traversable(path: str, uid: int, gids: set) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    bits = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid in gids else stat.S_IXOTH
    return bool(st.st_mode & bits)


def blocked_ancestor(path: str, uid: int, gids: set):
    """The first directory on the way from ``/`` to ``path`` that ``uid`` cannot search, or None."""
    parts = os.path.realpath(path).strip("/").split("/")
    for i in range(len(parts) + 1):
        p = "/" + "/".join(parts[:i])
        if not _traversable(p, uid, gids):
            return p
    return None


def under(path: str, root: str) -> bool:
    """Whether ``path`` is ``root`` or lies below it (both absolute, normalised)."""
    return path == root or path.startswith(root.rstrip("/") + "/")


def _hide(hidden: list, keep: dict, uid: int, gid: int) -> None:
    """An empty read-only tmpfs over each hidden directory, with the kept directories (the
    interpreter's) bound back at their paths, read-only (a bind inherits the remounted flags)."""
    for h in hidden:
        if not os.path.isdir(h) or under(h, "/tmp"):  # /tmp is replaced whole (_setup_filesystem)
            continue
        _mount("tmpfs", h, "tmpfs", MS_NOSUID | MS_NODEV, f"size=1m,mode=0755,uid={uid},gid={gid}")
        for path, fd in keep.items():
            if under(path, h):
                os.makedirs(path, 0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount(None, h, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _setup_filesystem(a: dict, keep: dict) -> None:
    uid, gid = a["uid"], a["gid"]
    for h in HIDDEN_EMPTY:
        if os.path.isdir(h):
            _mount("tmpfs", h, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0755")
    _hide(a["hidden"], keep, uid, gid)
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={a['scratch_bytes']},mode=0700,uid={uid},gid={gid}")
    for path, fd in keep.items():  # an interpreter under /tmp (a virtualenv in a fresh CI clone): bound back
        if path != "/tmp" and under(path, "/tmp"):  # read-only (a bind inherits the remounted flags; _verify checks)
            os.makedirs(path, 0o755, exist_ok=True)
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)


def _drop_privileges() -> None:
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _check(_prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), f"prctl(PR_CAPBSET_DROP, {cap})")
    _check(_prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # two {effective, permitted, inheritable} words, all zero
    _check(_libc.capset(header, data), "capset")


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def seccomp_program(machine: str) -> list[tuple[int, int, int, int]]:
    """The classic-BPF filter (code, jt, jf, k) refusing :data:`SECCOMP_DENY` on ``machine``: another
    ABI's call (audit arch, x32 numbers) and a listed number return EPERM, anything else is allowed."""
    if machine not in SECCOMP_DENY:
        raise SetupError(f"no seccomp syscall table for the {machine} architecture (x86_64 and aarch64 are "
                         f"supported); the sandbox cannot bound shared memory here, so nothing runs")
    audit_arch, other_abi, numbers = SECCOMP_DENY[machine]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    nrs = sorted(set(numbers.values()))
    n = len(nrs)
    prog = [(ld, 0, 0, 4)]  # A = seccomp_data.arch
    prog.append((jeq, 0, 1 + (other_abi is not None) + n + 1, audit_arch))  # another arch: to the refusal
    prog.append((ld, 0, 0, 0))  # A = seccomp_data.nr
    if other_abi is not None:
        prog.append((jge, n + 1, 0, other_abi))
    prog += [(jeq, n - i, 0, nr) for i, nr in enumerate(nrs)]  # a listed call: over the rest, to the refusal
    prog += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | errno.EPERM)]  # ALLOW, ERRNO(EPERM)
    return prog


def _deny_unbounded_memory() -> None:
    """Install :func:`seccomp_program` (needs no_new_privs, set by :func:`_drop_privileges`)."""
    prog = seccomp_program(os.uname().machine)
    insns = (_SockFilter * len(prog))(*[_SockFilter(*i) for i in prog])
    fprog = _SockFprog(len(prog), insns)
    _check(_prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")


def _verify() -> None:
    """Fail closed: no capability left, the seccomp filter on, every visible mount read-only except
    the scratch /tmp."""
    with open("/proc/self/status") as f:
        status = {k: v.strip() for k, v in (line.split(":", 1) for line in f)}
    caps = {k: v for k, v in status.items() if k.startswith("Cap")}
    if any(int(v, 16) for v in caps.values()):
        raise SetupError(f"capabilities left after dropping them: {caps}")
    if status.get("Seccomp") != "2":
        raise SetupError(f"the seccomp filter is not in force (Seccomp: {status.get('Seccomp')})")
    for point, _ in _mounts():
        if point == "/tmp":  # the scratch folder; the interpreter's folders bound below it are checked
            continue
        try:
            writable = not os.statvfs(point).f_flag & os.ST_RDONLY
        except OSError:
            continue  # hidden under a tmpfs
        if writable:
            raise SetupError(f"{point} is still writable inside the sandbox")


def _limits(a: dict) -> None:
    # RLIMIT_NPROC counts this user's tasks in the namespace: S and P1, plus what the code may start.
    for what, v in ((resource.RLIMIT_AS, a["memory_bytes"]), (resource.RLIMIT_CPU, a["cpu_s"]),
                    (resource.RLIMIT_FSIZE, a["file_bytes"]), (resource.RLIMIT_NOFILE, 64),
                    (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 2 + a["max_processes"]),
                    (resource.RLIMIT_MSGQUEUE, 0)):  # POSIX message queues: no kernel memory either
        resource.setrlimit(what, (v, v))


def _run_pid1(a: dict, say, script: bytes) -> None:
    """P1: own /proc, no privileges, limits, then exec the code. Never returns."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        proc = "own /proc"
        if _libc.mount(b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None) != 0:
            # a container whose /proc is partly masked refuses a new proc mount: hide it instead
            _mount("tmpfs", "/proc", "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
            proc = "no /proc (the kernel refused a new proc mount)"
        _drop_privileges()
        _deny_unbounded_memory()
        _verify()
        exe = a["interpreter"]
        if not os.access(exe, os.X_OK):
            raise SetupError(f"the interpreter {exe} cannot be executed inside the sandbox "
                             f"({'not executable' if os.path.exists(exe) else 'not found'} there)")
        with open("/tmp/main.py", "wb") as f:
            f.write(script)
        _limits(a)
        os.chdir("/tmp")
        say(f"ready user+mount+pid+net+ipc namespaces, uid {a['uid']}, read-only filesystem, {proc}, "
            f"seccomp (no SysV IPC, no memfd)")
        os.set_inheritable(a["status_fd"], False)  # closed by the exec; still open to report its failure
        try:
            os.execve(exe, [exe, "-I", "main.py"], a["env"])
        except OSError as e:
            raise SetupError(f"the interpreter {exe} could not be started inside the sandbox: {e}") from None
    except BaseException as e:  # noqa: BLE001 - report whatever stopped the set-up, run nothing
        say(f"error {type(e).__name__}: {e}")
    os._exit(SETUP_FAILED)


def main() -> None:
    a = json.loads(sys.argv[1])
    status, ctl = a["status_fd"], a["ctl_fd"]

    def say(msg: str) -> None:
        os.write(status, (" ".join(msg.split()) + "\n").encode())

    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the trainer died: so does the sandbox
        with open(a["script"], "rb") as f:
            script = f.read()
        if os.geteuid() == 0:
            os.setgroups([])
        _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC),
               "unshare(user, mount, pid, net, ipc namespaces)")
        say("unshared")
        reply = os.read(ctl, 256).decode().split()
        if reply[:1] != ["go"]:
            raise SetupError(f"the trainer did not map the sandbox uid: {' '.join(reply) or 'no answer'}")
        a["uid"], a["gid"] = int(reply[1]), int(reply[2])
        os.close(ctl)
        _remount_all_readonly()
        # opened in the new mount namespace (a bind source must be there), before giving up the uid
        # that can reach them (as root: the owner of /root)
        keep = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in a["keep"]}
        os.setresgid(a["gid"], a["gid"], a["gid"])
        os.setresuid(a["uid"], a["uid"], a["uid"])
        _setup_filesystem(a, keep)
        for fd in keep.values():
            os.close(fd)
        pid = os.fork()
        if pid == 0:
            _run_pid1(a, say, script)
    except BaseException as e:  # noqa: BLE001
        say(f"error {type(e).__name__}: {e}")
        os._exit(SETUP_FAILED)
    timed_out = []

    def deadline(signum, frame):
        timed_out.append(1)
        os.kill(pid, signal.SIGKILL)  # PID 1 of the namespace: the kernel kills the rest

    signal.signal(signal.SIGALRM, deadline)
    signal.setitimer(signal.ITIMER_REAL, a["timeout_s"])
    _, wstatus = os.waitpid(pid, 0)  # returns once every process of the namespace is gone
    signal.setitimer(signal.ITIMER_REAL, 0)
    say(f"exit {wstatus} {int(bool(timed_out))}")
    os._exit(0)


if __name__ == "__main__":
    main()
