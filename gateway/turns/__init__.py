"""The turn pipeline every protocol shares: request -> render -> generate with resume -> parse -> record."""
