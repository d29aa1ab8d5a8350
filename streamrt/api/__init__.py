"""The Python API: a loaded model behind one small object, without the command line."""
