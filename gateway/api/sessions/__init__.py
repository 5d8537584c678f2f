"""Session routes: read a session, finish it with its reward."""
