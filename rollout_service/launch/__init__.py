"""Starting the service's processes: their commands, and the supervisor that keeps them alive."""
