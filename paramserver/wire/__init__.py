"""The wire contract shared by servers and clients; holds no logic that only one side runs."""
