"""Starting a job's ranks and ending them: the checks made before any rank starts (preflight.py, data_check.py),
the launcher of local ranks and hosts (launcher.py, hosts.py: a multi-host job's hosts at the rendezvous), the stop
signals (signals.py), each failed rank's report and the job's one failure line (failure.py), and the launchers'
temporary log folders (log_dirs.py)."""
