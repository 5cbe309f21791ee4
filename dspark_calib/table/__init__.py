"""The cost table: what it is (model.py), its file with the format history and migrations
(file.py), what a file says of itself before any column is read (meta.py), its content hash
(identity.py), and the bounded listing of tables a load decision may read (sources.py)."""
