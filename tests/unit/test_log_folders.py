"""Where a node's files go (ftrun/agent/log_folders.py)."""

from __future__ import annotations

import os

from ftrun.agent.log_folders import LogFolders
from tests.unit.node_parts import launch_config


def test_under_log_dir_the_run_and_each_node_have_a_folder_made_once(tmp_path):
    folders = LogFolders(launch_config(tmp_path, "0", log_dir=str(tmp_path / "logs")))
    run = folders.run_folder()
    assert run == folders.run_folder() and os.path.dirname(run) == str(tmp_path / "logs")
    node = folders.node_folder(1)
    assert node == os.path.join(run, "node1") and os.path.isdir(node)


def test_torchruns_layout_puts_the_nodes_files_in_the_runs_folder(tmp_path):
    folders = LogFolders(launch_config(tmp_path, "0", log_dir=str(tmp_path / "logs"), log_layout="torchrun"))
    assert folders.node_folder(0) == folders.run_folder()


def test_without_log_dir_the_error_files_go_with_the_job(tmp_path):
    folders = LogFolders(launch_config(tmp_path, "0"))
    assert folders.run_folder() == ""
    node = folders.node_folder(0)
    assert os.path.isdir(node) and folders.temporary == node  # the agent tells its guardian of it
    folders.cleanup()
    assert not os.path.exists(node)
    folders.cleanup()  # the agent's end cleans up again, whatever ended it: nothing left to do


def test_without_log_dir_asked_for_files_are_kept(tmp_path):
    folders = LogFolders(launch_config(tmp_path, "0", tee="3"))
    node = folders.node_folder(0)
    assert folders.temporary == ""
    folders.cleanup()
    assert os.path.isdir(node)
    os.rmdir(node)
