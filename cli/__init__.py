"""The ``dbsync`` command line: a thin layer over the library (see ``cli.main``)."""
