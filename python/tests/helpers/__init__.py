"""What the tests share besides conftest.py's fixtures: stfiles, the
safetensors files and bundles they read. Import as helpers.stfiles;
python/tests, conftest.py's directory, is on sys.path under pytest."""
