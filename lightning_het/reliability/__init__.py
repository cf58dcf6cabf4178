"""Jobs that end cleanly: hung/dead replica watchdog, preemption, launcher lifecycle, checkpoint records."""
