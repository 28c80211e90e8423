"""Whether a file lies on a FUSE mount, whose `stat` a user-space server makes up.

A kernel file system sets a file's ctime itself at every write and no call can set it
back, so (device, inode, size, mtime, ctime) equal to a kept version means the content
is the one that was hashed. A FUSE server (s3fs, gcsfuse, rclone and other object
store mounts) answers `stat` as it likes: ctime is often the object's modification
time, which a copy tool sets from its source, and inode numbers are made up from the
path. The digest cache keeps nothing across starts for such files (`file_digest.py`).

A file's mount is found by its device number in `/proc/self/mountinfo`, read once per
checkpoint (0.03 ms with 20 mounts): a FUSE mount's files report the mount's own
device. A device that is not listed (a btrfs subvolume reports a device of its own) is
a kernel file system's; an unreadable mountinfo counts every file as FUSE's (the cache
goes unused, nothing is wrong).

Imports the standard library only.
"""

from __future__ import annotations

import os

MOUNTINFO = "/proc/self/mountinfo"


def fuse_devices() -> frozenset[int] | None:
    """The devices (`st_dev`) of this process's FUSE mounts (`fuse`, `fuseblk`,
    `fuse.<server>`); None where mountinfo cannot be read."""
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    found = set()
    for line in lines:
        # "36 35 98:0 /root /mnt rw,noatime shared:1 - ext4 /dev/sda1 rw": the
        # device is the third field, the file system type the first after " - ".
        fields, _, after = line.partition(" - ")
        parts = fields.split()
        fs_type = after.split(" ", 1)[0]
        if len(parts) > 2 and (
            fs_type in ("fuse", "fuseblk") or fs_type.startswith("fuse.")
        ):
            major, _, minor = parts[2].partition(":")
            try:
                found.add(os.makedev(int(major), int(minor)))
            except ValueError:
                return None  # a line not understood: cannot tell
    return frozenset(found)


def on_fuse(st_dev: int, devices: frozenset[int] | None) -> bool:
    """Whether device `st_dev` is one of `devices` (`fuse_devices()`), or cannot be
    told (None)."""
    return devices is None or st_dev in devices
