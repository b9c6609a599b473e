"""``python -m dbsync``: the ``dbsync`` command, for environments whose scripts directory is
not on ``PATH`` (a virtual environment not activated, ``pip install --user``, a container's
``python`` called by its full path). The same arguments, output and exit codes.

The command's package (``dbsync_cli``) is imported here only: the library never depends on it.
"""

from dbsync_cli.main import main

if __name__ == "__main__":
    main()
