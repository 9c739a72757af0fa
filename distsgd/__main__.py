import sys

from distsgd.cli import interrupted_while_starting, main

try:
    from distsgd.launch import exit_worker, under_launcher
except KeyboardInterrupt:  # Ctrl-C while torch is imported
    sys.exit(interrupted_while_starting())

if under_launcher():
    # a rank under torchrun: end without interpreter shutdown (see exit_worker)
    exit_worker(main)
sys.exit(main())
