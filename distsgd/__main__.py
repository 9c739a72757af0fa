import sys

from distsgd.cli import main
from distsgd.launch import exit_worker, under_launcher

if under_launcher():
    # a rank under torchrun: end without interpreter shutdown (see exit_worker)
    exit_worker(main)
sys.exit(main())
