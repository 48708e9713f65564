"""The fault suite: hostile files, full disks, signals, refused commands and newcomer mistakes (issue 15)."""
