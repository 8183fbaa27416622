"""The ``lowtail`` command: thin parsing and rendering over the library."""
