package daemon

import "strings"

// SystemdUnit is deploy/systemd/gpushm.service with the binary's path and
// the daemon's flags filled in; a test keeps the two the same.
func SystemdUnit(exe string, flags []string) string {
	args := append([]string{"daemon", "--socket", "/run/gpushm/gpushm.sock", "--fd-store"}, flags...)
	return `# gpushm: named GPU memory segments shared between processes.
#
# The main process is gpushm's supervisor: it holds every segment and runs
# the serving process, restarting it if it dies. Its own state is copied
# into systemd's file descriptor store, so a restart of the whole service
# loses nothing either:
#   systemctl reload gpushm    upgrade: the binary on disk takes over, no
#                              segment lost, no client dropped
#   systemctl restart gpushm   every segment comes back (systemd 254 and
#                              later: FileDescriptorStorePreserve=restart)
#   systemctl stop gpushm      stop for good: every segment is freed
[Unit]
Description=gpushm: named GPU memory segments shared between processes
After=nvidia-persistenced.service

[Service]
Type=notify
NotifyAccess=main
ExecStart=` + exe + " " + strings.Join(args, " ") + `
ExecReload=/bin/kill -HUP $MAINPID
Restart=always
RestartSec=1s
# SIGTERM to the supervisor only: it stops the serving process in order.
KillMode=mixed
TimeoutStopSec=60
# Every segment is a descriptor in systemd's store. A restart hands them
# back with their names in one environment variable, LISTEN_FDNAMES, which
# the kernel bounds to 128 KiB: 6144 names fit, whatever the segment ids.
# The daemon holds no more segments than the store keeps (6140), and its
# other limits follow from LimitNOFILE: 55300 connections, 4096
# descriptors for itself (docs/security.md, "Limits").
FileDescriptorStoreMax=6144
FileDescriptorStorePreserve=restart
RuntimeDirectory=gpushm
RuntimeDirectoryPreserve=restart
LimitNOFILE=65536
LimitMEMLOCK=infinity

[Install]
WantedBy=multi-user.target
`
}
