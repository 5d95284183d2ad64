"""The code-execution tool's sandbox (megaforge.rollout.agent.sandbox): a kernel boundary, probed the way
model-written code would try to escape it. Every escape probe first tries to switch off any
Python-level guard (``__main__.BLOCKED.clear()``, what broke the old audit hook), so what holds
is the kernel: namespaces, an unprivileged uid, read-only mounts, rlimits."""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest

from megaforge.rollout.agent import sandbox
from megaforge.rollout.agent.sandbox import SandboxUnavailable, run_code
from megaforge.rollout.agent.sandbox_child import HIDDEN_EMPTY
from megaforge.rollout.agent.tools import PythonTool

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DISABLE_GUARDS = "try:\n    import __main__; __main__.BLOCKED.clear()\nexcept Exception:\n    pass\n"


def _kernel_grants_namespaces() -> str:
    """'' when this kernel lets this user create the namespaces the sandbox needs (checked without
    megaforge's code, so a broken sandbox fails its tests instead of skipping them)."""
    probe = ("import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
             "rc = libc.unshare(0x10000000 | 0x20000 | 0x20000000 | 0x40000000 | 0x8000000)\n"
             "print(rc, os.strerror(ctypes.get_errno()))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout.split(None, 1)
    return "" if out and out[0] == "0" else f"the kernel refuses user+mount+pid+net+ipc namespaces here: {out}"


_WHY = _kernel_grants_namespaces()
needs_namespaces = pytest.mark.skipif(bool(_WHY), reason=_WHY)
pytestmark = needs_namespaces


def probe(code: str, **kw):
    return run_code(DISABLE_GUARDS + textwrap.dedent(code), **kw)


def test_runs_code_and_returns_stdout():
    r = run_code("import math\nprint(6 * 7, math.factorial(5))")
    assert r.ok and r.stdout == "42 120\n" and not r.timed_out
    assert "user+mount+pid+net+ipc namespaces" in r.isolation
    assert sandbox.unavailable_reason() is None and sandbox.require() == sandbox.require()


def test_timeout_kills_the_process():
    t = time.monotonic()
    r = run_code("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and not r.ok and "TimeoutError" in r.stderr
    assert time.monotonic() - t < 10
    # a sleeping child (no CPU used, so RLIMIT_CPU would never fire) is killed by the wall clock too
    r = run_code("import time\ntime.sleep(60)", timeout_s=1.0)
    assert r.timed_out


def test_memory_limit():
    r = run_code("x = bytearray(1024 ** 3)\nprint('allocated')", memory_mb=256)
    assert not r.ok and "MemoryError" in r.stderr and "allocated" not in r.stdout
    assert run_code("x = bytearray(16 * 1024 ** 2)\nprint(len(x))", memory_mb=256).stdout == f"{16 * 1024 ** 2}\n"


def test_no_shell_argument_list_only(monkeypatch):
    seen = []
    real = subprocess.Popen

    def spy(args, *a, **kw):
        seen.append((args, kw.get("shell", False)))
        return real(args, *a, **kw)

    monkeypatch.setattr(sandbox.subprocess, "Popen", spy)
    code = "print('hi'); import os\n# $(touch /tmp/pwned) `id` ; rm -rf /"
    run_code(code)
    (args, shell), = seen
    assert shell is False and isinstance(args, list) and args[0] == sys.executable
    assert not any(code in a or "$(" in a for a in args)  # the code never reaches the command line


def test_unprivileged_uid_no_capabilities_even_when_the_trainer_is_root():
    r = probe("""
        import os, sys
        status = dict(l.split(':', 1) for l in open('/proc/self/status'))
        print(os.getuid(), os.geteuid(), os.getgid(), os.getgroups())
        print(status['CapEff'].strip(), status['CapBnd'].strip(), status['NoNewPrivs'].strip())
        try:
            os.setuid(0)
            print('setuid(0) worked')
        except OSError:  # EINVAL: uid 0 does not exist in its user namespace
            print('setuid refused')
        sys.stdout.flush()
        os.execv('/usr/bin/id', ['id', '-u'])  # what the old sandbox printed as 0
    """)
    assert r.ok, r.stderr
    ids, caps, setuid, id_u = r.stdout.splitlines()
    uid, euid, gid, groups = ids.split(" ", 3)
    assert uid == euid == id_u != "0" and gid != "0" and "0" not in groups.strip("[]").replace(",", " ").split()
    if os.geteuid() == 0:  # a uid of its own, not the trainer's (root)
        assert int(uid) >= sandbox.SANDBOX_UID_BASE
    else:
        assert int(uid) == os.geteuid()
    assert caps == "0000000000000000 0000000000000000 1" and setuid == "setuid refused"


def test_fork_bomb_is_bounded_by_rlimit_nproc():
    bomb = """
        import os, time
        started, err = 0, None
        for _ in range(50):
            try:
                pid = os.fork()
            except OSError as e:
                err = e.errno
                continue
            if pid == 0:
                time.sleep(30)
                os._exit(0)
            started += 1
        print(started, err)
    """
    r = probe(bomb)
    assert r.ok and r.stdout == "0 11\n", r.stderr  # EAGAIN: RLIMIT_NPROC binds the unprivileged uid
    r = probe(bomb, max_processes=3)
    assert r.ok and r.stdout == "3 11\n", r.stderr
    r = probe("import subprocess\nsubprocess.run(['echo', 'pwned'])")
    assert not r.ok and "pwned" not in r.stdout and "BlockingIOError" in r.stderr


def _pids_in_namespace(ns: str) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.readlink(f"/proc/{p}/ns/pid") == ns:
                    out.append(int(p))
            except OSError:
                pass
    return out


def _pids_of_uid(uid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/status") as f:
                    if any(line.startswith("Uid:") and int(line.split()[1]) == uid for line in f):
                        out.append(int(p))
            except OSError:
                pass
    return out


def test_setsid_descendants_die_at_the_deadline():
    r = probe("""
        import os, sys, time
        print(os.readlink('/proc/self/ns/pid'), flush=True)
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()  # leaves the process group the old sandbox killed
                if os.fork() == 0:
                    while True:
                        time.sleep(0.1)
                while True:
                    time.sleep(0.1)
        time.sleep(60)
    """, timeout_s=2.0, max_processes=8)
    assert r.timed_out
    ns = r.stdout.split()[0]
    uid = int(r.isolation.split("uid ")[1].split(",")[0])
    assert ns != os.readlink("/proc/self/ns/pid")
    assert _pids_in_namespace(ns) == [] and _pids_of_uid(uid) == []  # gone when run_code returns
    time.sleep(1.0)
    assert _pids_in_namespace(ns) == [] and _pids_of_uid(uid) == []


def _hidden_in_sandbox(path: str) -> bool:
    """Whether the sandbox hides `path` (its private /tmp, the emptied world-writable folders, the
    trainer's home): a probe there would fail to open for that reason, not the read-only mounts."""
    hidden = ("/tmp", "/root", "/home") + HIDDEN_EMPTY + (os.path.expanduser("~"),)
    real = os.path.realpath(path)
    return any(real == h or real.startswith(h.rstrip("/") + "/") for h in hidden)


@pytest.fixture
def visible_dir():
    """A world-writable directory the sandbox sees (the checkout, or where the checkout is itself
    under /tmp, as in a fresh CI clone, a folder of /run, /var/lib or /srv): only the read-only
    mounts keep the code from writing there, not permissions."""
    bases = [b for b in (ROOT, "/run", "/var/lib", "/srv")
             if os.path.isdir(b) and os.access(b, os.W_OK) and not _hidden_in_sandbox(b)]
    if not bases:
        pytest.skip("no writable folder outside the sandbox's hidden ones (/tmp, /dev/shm, home, ...)")
    d = tempfile.mkdtemp(prefix=".sandbox-probe-", dir=bases[0])
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_writes_outside_the_scratch_folder_fail(visible_dir):
    tag = f"megaforge-probe-{os.getpid()}-{time.monotonic_ns()}"
    targets = {"open": f"{visible_dir}/a", "shm": f"/dev/shm/{tag}", "vartmp": f"/var/tmp/{tag}",
               "sqlite": f"{visible_dir}/d.db", "libc": f"{visible_dir}/e"}
    r = probe(f"""
        import ctypes, os, sqlite3
        T = {targets!r}
        def attempt(name, fn):
            try:
                fn()
                print(name, 'WROTE')
            except Exception as e:
                print(name, type(e).__name__)
        attempt('open', lambda: open(T['open'], 'w').write('x'))
        attempt('shm', lambda: open(T['shm'], 'w').write('x'))
        attempt('vartmp', lambda: open(T['vartmp'], 'w').write('x'))
        d = os.open({visible_dir!r}, os.O_RDONLY)
        attempt('dir_fd', lambda: os.write(os.open('b', os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=d), b'x'))
        open('inside.txt', 'w').write('x')
        attempt('rename', lambda: os.rename('inside.txt', 'c', dst_dir_fd=d))
        attempt('sqlite', lambda: sqlite3.connect(T['sqlite']).execute('create table t (x)'))
        libc = ctypes.CDLL(None, use_errno=True)
        def raw():
            if libc.open(T['libc'].encode(), os.O_CREAT | os.O_WRONLY, 0o644) < 0:
                raise OSError(ctypes.get_errno(), 'libc open')
        attempt('libc', raw)
        attempt('scratch', lambda: open('ok.txt', 'w').write('x'))
    """)
    assert r.ok, r.stderr
    got = dict(line.split() for line in r.stdout.splitlines())
    assert got.pop("scratch") == "WROTE"
    assert all(v != "WROTE" for v in got.values()), got
    assert os.listdir(visible_dir) == [] and not any(os.path.exists(p) for p in targets.values())


def test_trainer_environment_is_not_readable():
    """The trainer's secrets in its environment: not in the code's environment, and not through
    /proc/<ppid>/environ or any other /proc entry."""
    code = DISABLE_GUARDS + textwrap.dedent("""
        import os
        seen = []
        for pid in ['self', str(os.getppid()), 'TRAINER'] + os.listdir('/proc'):
            try:
                seen.append(open(f'/proc/{pid}/environ', 'rb').read().decode('latin-1'))
            except OSError:
                pass
        seen.append(repr(dict(os.environ)))
        print('LEAKED' if any('hunter2' in s for s in seen) else 'clean', os.getppid())
    """)
    trainer = ("import os, sys; from megaforge.rollout.agent.sandbox import run_code\n"
               f"r = run_code({code!r}.replace('TRAINER', str(os.getpid())))\n"
               "print(r.stdout.strip() or r.stderr)")
    env = dict(os.environ, MEGAFORGE_TEST_SECRET="hunter2", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", trainer], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["clean", "0"], out.stdout + out.stderr  # ppid 0: the parent is outside


def test_no_network_even_to_a_local_listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    got = []
    th = threading.Thread(target=lambda: got.append(srv.accept()), daemon=True)
    th.start()
    r = probe(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')")
    time.sleep(0.2)
    srv.close()
    assert "connected" not in r.stdout and not got


def test_private_scratch_folder_and_clean_environment():
    tag = f"scratch-{os.getpid()}-{time.monotonic_ns()}.txt"
    os.environ["MEGAFORGE_TEST_SECRET"] = "hunter2"
    try:
        r = run_code(f"import os\nopen({tag!r}, 'w').write('x')\nprint(os.getcwd())\n"
                     "print(os.environ.get('MEGAFORGE_TEST_SECRET'))\nprint(sorted(os.listdir('.')))\n"
                     "print(sorted(os.listdir('/root')), sorted(os.listdir('/dev/shm')))")
    finally:
        del os.environ["MEGAFORGE_TEST_SECRET"]
    cwd, secret, listing, hidden = r.stdout.splitlines()
    assert r.ok and cwd == "/tmp" and secret == "None" and tag in listing
    assert not os.path.exists(os.path.join("/tmp", tag))  # a private tmpfs, gone afterwards
    assert ".bashrc" not in hidden and hidden.endswith("[]")  # home hidden (the interpreter bound back), shm empty
    # the scratch folder is bounded as a whole (scratch_mb), not only per file (file_mb)
    r = run_code("import os\nfor i in range(4):\n    open(f'f{i}', 'wb').write(os.urandom(3 << 20))",
                 scratch_mb=8, file_mb=16)
    assert not r.ok and "No space left on device" in r.stderr


def test_output_is_bounded():
    r = run_code("print('x' * 100000)", max_output_bytes=1000)
    assert len(r.stdout) == 1000 and r.truncated


# Runs argv[1:] as root of a new user namespace (uid/gid 0 mapped to 0, setgroups allowed) in which no
# further user namespace may be created: a kernel that refuses the sandbox its namespaces.
NO_NESTED_USERNS = """
import ctypes, os, sys
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(w)
    if ctypes.CDLL(None, use_errno=True).unshare(0x10000000) != 0:
        os._exit(3)
    os.read(r, 1)
    open('/proc/sys/user/max_user_namespaces', 'w').write('0')
    os.execv(sys.argv[1], sys.argv[1:])
os.close(r)
import time; time.sleep(0.2)
for name, text in (('uid_map', '0 0 1'), ('setgroups', 'allow'), ('gid_map', '0 0 1')):
    open(f'/proc/{pid}/{name}', 'w').write(text)
os.write(w, b'x')
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def test_refuses_clearly_when_the_kernel_denies_namespaces(tmp_path):
    """With user namespaces disallowed, run_code raises SandboxUnavailable naming the step that
    failed and what to change; the code does not run."""
    if os.geteuid() != 0:
        pytest.skip("building a namespace that forbids user namespaces needs root here")
    marker = tmp_path / "ran"
    trainer = ("from megaforge.rollout.agent.sandbox import run_code, SandboxUnavailable\n"
               f"try:\n    run_code(\"open({str(marker)!r}, 'w')\")\n    print('RAN')\n"
               "except SandboxUnavailable as e:\n    print('REFUSED', e)\n")
    out = subprocess.run([sys.executable, "-c", NO_NESTED_USERNS, sys.executable, "-c", trainer],
                         env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert out.stdout.startswith("REFUSED sandbox set-up failed: SetupError: unshare(user, mount, pid, net, ipc "
                                 "namespaces): No space left on device"), out.stdout + out.stderr
    assert "allow unprivileged user namespaces" in out.stdout and not marker.exists()


def test_python_tool_answers_output_or_error():
    tool = PythonTool(timeout_s=2.0, memory_mb=256)
    assert tool("print(sum(range(10)))") == "45"
    assert tool("```python\nprint(2 ** 10)\n```") == "1024"
    assert tool("1/0") == "error: ZeroDivisionError: division by zero"
    assert tool("while True: pass").startswith("error: TimeoutError")
    assert tool("import subprocess; subprocess.run(['id'])") == \
        "error: BlockingIOError: [Errno 11] Resource temporarily unavailable"



def test_an_interpreter_under_tmp_runs_and_stays_read_only(tmp_path):
    # A virtualenv under /tmp (a fresh CI clone's): the sandbox's private /tmp hid it, so nothing
    # could run. Its folder is bound back read-only: the code runs, and cannot write there.
    venv = str(tmp_path / "venv")
    assert venv.startswith("/tmp/"), venv  # pytest's tmp_path is under /tmp here; the case needs it
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    import site

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + site.getsitepackages()))
    probe = ("import sys\nprint(sys.prefix)\ntry:\n    open(sys.prefix + '/x', 'w')\n    print('wrote')\n"
             "except OSError as e:\n    print('refused', e.errno)\n")
    driver = ("from megaforge.rollout.agent.sandbox import run_code\n"
              f"r = run_code({probe!r})\nprint(r.ok, repr(r.stdout), repr(r.stderr[-300:]))\n")
    out = subprocess.run([os.path.join(venv, "bin", "python"), "-c", driver], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"True '{venv}\\nrefused 30"), out.stdout  # EROFS: the bind is read-only
    assert not os.path.exists(os.path.join(venv, "x"))


def test_shared_memory_and_memfds_stay_within_the_memory_budget():
    """Issue 40 case 1: with memory_mb 256 the code held 2 GiB of SysV shared memory (RLIMIT_AS does
    not count a detached segment; the IPC namespace had no shmmax/shmall) and ~1 GB in memfds (each
    up to file_mb, kept open, unmapped). Both are refused now: what the code holds outside its
    address space is the scratch /tmp only."""
    r = probe("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        libc.shmat.restype = ctypes.c_void_p
        libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
        libc.shmdt.argtypes = [ctypes.c_void_p]
        shm, err = 0, 0
        for _ in range(4):  # 4 x 64 MiB, each touched, then detached: 256 MiB held by the kernel
            sid = libc.shmget(0, 64 << 20, 0o1600)  # IPC_PRIVATE | IPC_CREAT | 0600
            if sid < 0:
                err = ctypes.get_errno()
                break
            addr = libc.shmat(sid, None, 0)
            ctypes.memset(addr, 1, 64 << 20)
            libc.shmdt(addr)
            shm += 64
        print('shm', shm, err)
        memfd, fds, chunk = 0, [], b'x' * (1 << 20)
        try:
            for _ in range(16):  # 16 memfds of 16 MiB (file_mb) kept open: 256 MiB outside RLIMIT_AS
                fd = os.memfd_create('m')
                for _ in range(16):
                    os.write(fd, chunk)
                fds.append(fd)
                memfd += 16
            print('memfd', memfd, 0)
        except OSError as e:
            print('memfd', memfd, e.errno)
    """, memory_mb=128, file_mb=16, timeout_s=30)
    assert r.ok, r.stderr
    got = {k: (int(mib), int(err)) for k, mib, err in (line.split() for line in r.stdout.splitlines())}
    assert got == {"shm": (0, 1), "memfd": (0, 1)}, got  # EPERM: the seccomp filter refuses both
    assert "seccomp" in r.isolation


def test_seccomp_program_refuses_other_abis_and_unknown_architectures():
    from megaforge.rollout.agent.sandbox_child import SECCOMP_DENY, SetupError, seccomp_program

    for machine, (arch, other_abi, numbers) in SECCOMP_DENY.items():
        prog = seccomp_program(machine)
        deny, allow = len(prog) - 1, len(prog) - 2
        assert prog[deny] == (0x06, 0, 0, 0x50001) and prog[allow] == (0x06, 0, 0, 0x7FFF0000)
        for i, (code, jt, jf, k) in enumerate(prog):  # every jump to the refusal lands on it
            if code == 0x15 and k == arch:
                assert i + 1 + jf == deny
            elif code in (0x15, 0x35) and i > 2:
                assert i + 1 + jt == deny and (k in numbers.values() or k == other_abi)
        assert {k for code, _, _, k in prog if code == 0x15 and k != arch} == set(numbers.values())
    with pytest.raises(SetupError, match="no seccomp syscall table for the riscv64 architecture"):
        seccomp_program("riscv64")


def test_an_interpreter_that_cannot_start_is_a_setup_error_naming_it(monkeypatch, visible_dir):
    """The partly-held case of issue 40: an interpreter the sandbox cannot start was reported as the
    code's timeout. It is a set-up error naming the interpreter, without the namespace hint."""
    missing = os.path.join(visible_dir, "no-such-python")
    monkeypatch.setattr(sandbox, "interpreter", lambda: missing)
    with pytest.raises(SandboxUnavailable, match=f"the interpreter {missing} cannot be executed inside the "
                                                 r"sandbox \(not found there\)") as e:
        run_code("print(1)")
    assert "user namespaces" not in str(e.value)
    garbage = os.path.join(visible_dir, "python")  # executable, but no program the kernel can start
    with open(garbage, "w") as f:
        f.write("not a program\n")
    os.chmod(garbage, 0o755)
    monkeypatch.setattr(sandbox, "interpreter", lambda: garbage)
    with pytest.raises(SandboxUnavailable, match=f"the interpreter {garbage} could not be started inside the "
                                                 r"sandbox: \[Errno 8\] Exec format error"):
        run_code("print(1)")


def test_a_virtualenv_reached_through_a_symlinked_folder_runs(tmp_path):
    """A venv run as <link>/bin/python, <link> a symlink to the venv: the sandbox bound the venv's real
    folder back but exec'd the path through the link, which does not exist there (a 'timeout')."""
    real, link = tmp_path / "venv", tmp_path / "link"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(real)], check=True, timeout=120)
    os.symlink(real, link)
    import site

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + site.getsitepackages()))
    driver = ("from megaforge.rollout.agent.sandbox import run_code\n"
              "r = run_code('import sys; print(sys.prefix)')\nprint(r.ok, repr(r.stdout), repr(r.stderr[-300:]))\n")
    out = subprocess.run([str(link / "bin" / "python"), "-c", driver], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.startswith(f"True '{real}\\n'"), out.stdout + out.stderr[-2000:]
