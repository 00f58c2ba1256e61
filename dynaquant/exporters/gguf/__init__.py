"""GGUF output: the file writer (``writer``), the mmproj writer (``mmproj``) and the summary reader (``inspect``)."""
