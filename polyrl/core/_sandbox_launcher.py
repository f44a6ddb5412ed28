"""The sandbox launcher, run once per call as ``python -I -S _sandbox_launcher.py``.

Started by :mod:`polyrl.core.sandbox`, never imported. Standard library only, and few imports
(``marshal`` instead of ``json``, whose import costs more than all the rest).

Reads ``marshal.dumps((config, source))`` from stdin, then (isolation ``"namespaces"``):

1. drops root's supplementary groups and forks a child, which unshares user, mount, PID,
   network, IPC, UTS and cgroup namespaces; the launcher, still in the parent user namespace,
   maps one uid/gid in the child's namespace (:data:`INNER_ID` inside; outside our own ids, or
   ``nobody``'s when root, so the sandbox is never host root and ``RLIMIT_NPROC``, which the
   kernel never enforces on uid 0, applies). No other id exists inside, root included;
2. the child opens every host path to expose (``O_PATH``: with the launcher's host uid, so a
   Python under a ``0700`` ``/root`` works), then becomes :data:`INNER_ID`;
3. it builds the new root on a small tmpfs: read-only binds of those paths, a minimal ``/dev``,
   and one size-limited tmpfs (``/tmp``, also ``/dev/shm``): the program's only writable place
   and working directory;
4. it forks the namespace's init (PID 1), which mounts a fresh ``/proc``, makes the root
   read-only, pivots into it (``pivot_root``; the host tree is detached), forks the program
   with its rlimits and ``no_new_privs``, reaps every orphan and reports the program's end on
   a pipe, then exits: the kernel then kills whatever is left in the namespace;
5. it waits for that report at most ``timeout`` seconds, else kills the init (which kills the
   whole namespace), and prints one status line on stderr: the ``repr`` of a dict.

The program's stdout and stderr both go to the launcher's stdout. Isolation ``"none"`` runs the
same init and program without namespaces, in a host temporary directory (unsafe).
"""

import ctypes
import errno
import marshal
import os
import resource
import select
import signal
import sys
import time

INNER_ID = 1000
HOST_NOBODY = 65534

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}

libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
libc.sethostname.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


class Unavailable(Exception):
    """The kernel refused a namespace step: the sandbox cannot work on this machine."""


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)} ({errno.errorcode.get(err, err)})")


def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else os.fsencode(s)  # noqa: E731
    check(libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def prctl(option, arg):
    check(libc.prctl(option, arg, 0, 0, 0), f"prctl {option}")


def write_file(path, text):
    with open(path, "w") as f:
        f.write(text)


def readonly_flags(path, nodev=True):
    """Return the flags remounting a bind read-only, keeping the source's locked flags."""
    st = os.statvfs(path).f_flag
    flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | (MS_NODEV if nodev else 0)
    for st_flag, ms_flag in (
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if st & st_flag:
            flags |= ms_flag
    if not st & (os.ST_NOATIME | os.ST_RELATIME):
        flags |= MS_STRICTATIME
    return flags


def open_paths(cfg):
    """O_PATH descriptors of everything to bind, opened with our full host rights."""
    fds = []
    for path in cfg["binds"] + [f"/dev/{d}" for d in cfg["devices"]]:
        try:
            fds.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC)))
        except FileNotFoundError:
            pass
    return fds


NS_FLAGS = (
    CLONE_NEWUSER
    | CLONE_NEWNS
    | CLONE_NEWPID
    | CLONE_NEWNET
    | CLONE_NEWIPC
    | CLONE_NEWUTS
    | CLONE_NEWCGROUP
)


def map_ids(pid):
    """Map INNER_ID in ``pid``'s user namespace to our uid/gid (``nobody``'s when root).

    Done from the parent user namespace, so root can map ``nobody``: the sandbox is never root.
    """
    outside = HOST_NOBODY if os.geteuid() == 0 else None
    try:
        write_file(f"/proc/{pid}/setgroups", "deny")
        write_file(f"/proc/{pid}/uid_map", f"{INNER_ID} {outside or os.geteuid()} 1\n")
        write_file(f"/proc/{pid}/gid_map", f"{INNER_ID} {outside or os.getegid()} 1\n")
    except OSError as exc:
        raise Unavailable(f"writing the user namespace's uid/gid maps failed: {exc}") from None


def enter_namespaces(to_parent, from_parent):
    """unshare, then have the parent map our ids (it is in the parent user namespace)."""
    if libc.unshare(NS_FLAGS) != 0:
        err = ctypes.get_errno()
        raise Unavailable(
            f"unshare(user, mount, pid, net, ipc, uts, cgroup namespaces) failed: "
            f"{errno.errorcode.get(err, err)} ({os.strerror(err)})"
        )
    os.write(to_parent, b"u")
    if os.read(from_parent, 1) != b"m":
        raise Unavailable("the parent could not map the user namespace's ids")
    name = b"sandbox"
    check(libc.sethostname(name, len(name)), "sethostname")


def become_inner_user():
    # Until now we may be host root (unmapped here): that let us open the paths to bind.
    os.setresgid(INNER_ID, INNER_ID, INNER_ID)
    os.setresuid(INNER_ID, INNER_ID, INNER_ID)


def build_root(cfg, fds, code):
    """Mount the new root's tree on a tmpfs over /tmp (in our private mount namespace)."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp"
    try:
        mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    except OSError as exc:
        raise Unavailable(f"mounting a tmpfs in the new mount namespace failed: {exc}") from None
    for path, fd in fds:
        target = root + path
        is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
        os.makedirs(target if is_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
        if not is_dir:
            os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
        mount(None, target, None, readonly_flags(target, nodev=not path.startswith("/dev/")))
        os.close(fd)
    for link, dest in cfg["symlinks"].items():
        os.makedirs(os.path.dirname(root + link), mode=0o755, exist_ok=True)
        os.symlink(dest, root + link)
    for name, dest in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                       ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.makedirs(f"{root}/dev", mode=0o755, exist_ok=True)
        os.symlink(dest, f"{root}/dev/{name}")
    for d in ("proc", "tmp", "dev/shm", ".w"):
        os.makedirs(f"{root}/{d}", mode=0o755, exist_ok=True)
    # The one writable filesystem, size-limited, shared by /tmp and /dev/shm; the staging
    # mount at /.w is detached again once both binds exist.
    data = (
        f"size={cfg['disk_mb']}m,nr_inodes={cfg['inodes']},mode=700,uid={INNER_ID},gid={INNER_ID}"
    )
    mount("tmpfs", f"{root}/.w", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, data)
    for d, target in (("tmp", "tmp"), ("shm", "dev/shm")):
        os.mkdir(f"{root}/.w/{d}", 0o700)
        mount(f"{root}/.w/{d}", f"{root}/{target}", None, MS_BIND)
    check(libc.umount2(os.fsencode(f"{root}/.w"), MNT_DETACH), "umount2 staging")
    os.rmdir(f"{root}/.w")
    with open(f"{root}/tmp/main.py", "wb") as f:
        f.write(code)
    return root


def enter_root(root):
    """In the new PID namespace: fresh /proc, read-only root, pivot_root, host tree detached."""
    try:
        mount("proc", f"{root}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError as exc:
        raise Unavailable(
            f"mounting /proc for the new PID namespace failed: {exc} (the host's /proc must "
            "be fully visible: no masked paths over it)"
        ) from None
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise Unavailable(f"no pivot_root syscall number known for {os.uname().machine}")
    os.chdir(root)
    check(libc.syscall(nr, b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount2 old root")
    os.chdir("/")


def set_limits(cfg, sandboxed):
    lim = resource.setrlimit
    lim(resource.RLIMIT_CPU, (cfg["cpu_seconds"], cfg["cpu_seconds"] + 1))
    lim(resource.RLIMIT_AS, (cfg["memory_bytes"], cfg["memory_bytes"]))
    lim(resource.RLIMIT_FSIZE, (cfg["file_size_bytes"], cfg["file_size_bytes"]))
    lim(resource.RLIMIT_CORE, (0, 0))
    lim(resource.RLIMIT_NOFILE, (cfg["max_open_files"], cfg["max_open_files"]))
    if sandboxed:
        # Counted per (user namespace, uid): the launcher and init are 2 of the processes.
        lim(resource.RLIMIT_NPROC, (cfg["max_procs"] + 2, cfg["max_procs"] + 2))


def run_program(cfg, sandboxed, workdir):
    """Become the program: limits, no_new_privs, then exec a fresh interpreter."""
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.dup2(1, 2)
    os.closerange(3, 65536)
    os.chdir(workdir)
    set_limits(cfg, sandboxed)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    exe = cfg["exe"]
    # A non-zero uid keeps no capabilities across execve.
    os.execve(exe, [exe, "-I", "-S", "-u", "-X", "utf8", "-c", cfg["boot"]], cfg["env"])


def init_process(cfg, sandboxed, root, workdir, status_w, lifeline_r):
    """PID 1 of the namespace (or a plain reaper when not sandboxed); never returns."""
    try:
        os.setsid()
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if select.select([lifeline_r], [], [], 0)[0]:  # the launcher died before prctl
            os._exit(1)
        prctl(PR_SET_DUMPABLE, 0)
        if sandboxed:
            enter_root(root)
        pid = os.fork()
        if pid == 0:
            try:
                os.close(status_w)
                run_program(cfg, sandboxed, workdir)
            finally:
                os._exit(127)
        while True:
            done, status = os.waitpid(-1, 0)
            if done == pid:
                break
        if os.WIFSIGNALED(status):
            report = {"signal": os.WTERMSIG(status)}
        else:
            report = {"exit_code": os.WEXITSTATUS(status)}
    except Unavailable as exc:
        report = {"error": str(exc), "unavailable": True}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        report = {"error": f"sandbox init failed: {exc!r}"}
    os.write(status_w, marshal.dumps(report))
    os._exit(0)


def supervise(cfg, sandboxed, root, workdir, start):
    """Start the init, wait for its report at most until the timeout; return the report."""
    status_r, status_w = os.pipe()
    lifeline_r, lifeline_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(status_r)
        os.close(lifeline_w)
        init_process(cfg, sandboxed, root, workdir, status_w, lifeline_r)
    os.close(status_w)
    os.close(lifeline_r)
    timeout = max(0.0, cfg["timeout"] - (time.monotonic() - start))
    ready = select.select([status_r], [], [], timeout)[0]
    report = load_report(os.read(status_r, 65536)) if ready else {"timed_out": True}
    try:
        if sandboxed:  # killing the init kills its whole PID namespace
            os.kill(pid, signal.SIGKILL)
        else:  # no PID namespace: what is left in the program's session is killed
            os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    # The init's exit completes only once every process in its namespace is gone.
    os.waitpid(pid, 0)
    return report


def load_report(data):
    """Decode the init's report (a marshalled dict, from our own code in the init)."""
    try:
        return marshal.loads(data)
    except (EOFError, ValueError, TypeError):
        return {"error": "the sandbox's init ended without a report"}


def die_with_parent(parent, undumpable=True):
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
    if undumpable:  # nobody else of our uid may ptrace us or open our /proc files
        prctl(PR_SET_DUMPABLE, 0)


def sandboxed_main(cfg, code, to_parent, from_parent, start):
    """Enter the namespaces, build the root, supervise the init (the launcher's child)."""
    parent = os.getppid()
    die_with_parent(parent, undumpable=False)
    prctl(PR_SET_DUMPABLE, 1)  # the parent (not root, maybe) must write our /proc/PID/uid_map
    try:
        enter_namespaces(to_parent, from_parent)
        fds = open_paths(cfg)
        become_inner_user()
        root = build_root(cfg, fds, code)
        die_with_parent(parent)  # the uid change cleared both
    except Unavailable as exc:
        return {"error": str(exc), "unavailable": True}
    except OSError as exc:
        return {"error": f"sandbox setup failed: {exc}"}
    return supervise(cfg, True, root, "/tmp", start)


def main():
    start = time.monotonic()
    cfg, code = marshal.loads(sys.stdin.buffer.read())
    devnull = os.open("/dev/null", os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    die_with_parent(cfg["parent"])
    if cfg["isolation"] != "namespaces":
        import shutil
        import tempfile

        workdir = tempfile.mkdtemp(prefix="polyrl-sandbox-")
        try:
            with open(os.path.join(workdir, "main.py"), "wb") as f:
                f.write(code)
            report = supervise(cfg, False, None, workdir, start)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        print(repr(report), file=sys.stderr)
        return 0
    if os.geteuid() == 0:
        try:
            os.setgroups([])  # root's supplementary groups must not reach the sandbox
        except PermissionError:  # root of a user namespace with setgroups denied: none to drop
            pass
    up_r, up_w = os.pipe()
    down_r, down_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(up_r)
        os.close(down_w)
        try:
            report = sandboxed_main(cfg, code, up_w, down_r, start)
            print(repr(report), file=sys.stderr, flush=True)
        finally:
            os._exit(0)
    os.close(up_w)
    os.close(down_r)
    report = None
    if os.read(up_r, 1) == b"u":
        try:
            map_ids(pid)
            os.write(down_w, b"m")
        except Unavailable as exc:
            report = {"error": str(exc), "unavailable": True}
    os.close(down_w)
    os.waitpid(pid, 0)
    if report is not None:
        print(repr(report), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
