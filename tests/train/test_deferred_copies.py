"""An async save's staging (train/checkpoint/deferred_copies.py): parameters and optimizer state are written
from the live tensors until the optimizer's next step, which copies what the writer has not taken and
waits for what it is writing; everything else is copied when the save is called."""

from __future__ import annotations

import threading

import torch

from runyard.train.checkpoint.deferred_copies import DeferredCopies


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    model[2].requires_grad_(False)  # frozen: not the optimizer's
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()  # the optimizer holds its moments
    return model, opt


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict]:
    optim = {f"state.{i}.{k}": v for i, s in enumerate(opt.state.values()) for k, v in s.items()}
    return {"model": dict(model.state_dict()), "optim": {**optim, "param_groups.lr": [g["lr"] for g in opt.param_groups]}}


def test_parameters_and_optimizer_state_stay_live_and_the_rest_is_copied_at_once():
    model, opt = model_and_optimizer()
    state = state_of(model, opt)
    staged = DeferredCopies().stage(state, opt)
    live = {"0.weight", "0.bias", "1.weight", "1.bias"}
    for key, value in state["model"].items():  # BatchNorm's running stats and the frozen layer: copied
        assert (staged["model"][key] is value) == (key in live), key
        assert torch.equal(staged["model"][key], value), key
    assert all(staged["optim"][k] is v for k, v in state["optim"].items() if isinstance(v, torch.Tensor))
    before = staged["model"]["1.running_mean"].clone()
    model(torch.randn(8, 4))  # a forward changes the running statistics; the staged copy keeps the saved ones
    assert torch.equal(staged["model"]["1.running_mean"], before)
    assert not torch.equal(state["model"]["1.running_mean"], before)
    opt.param_groups[0]["lr"] = 0.5  # the loop sets the next step's rate before its forward
    assert staged["optim"]["param_groups.lr"] == [0.1]


def test_the_optimizers_step_copies_what_the_writer_has_not_taken():
    model, opt = model_and_optimizer()
    copies = DeferredCopies()
    staged = copies.stage(state_of(model, opt), opt)
    weight, bias = staged["model"]["0.weight"], staged["model"]["0.bias"]
    saved_weight, saved_bias = weight.clone(), bias.clone()
    assert copies.take(weight) is weight  # written from the live tensor: no copy
    copies.done(weight)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()  # the hook copies the tensors not yet taken, then the step changes the live ones
    assert not torch.equal(weight, saved_weight) and not torch.equal(bias, saved_bias)
    got = copies.take(bias)
    assert got is not bias and torch.equal(got, saved_bias)
    copies.done(bias)
    assert copies.stalled_s > 0


def test_the_optimizers_step_waits_for_a_tensor_being_written():
    model, opt = model_and_optimizer()
    copies = DeferredCopies()
    staged = copies.stage(state_of(model, opt), opt)
    weight = staged["model"]["0.weight"]
    assert copies.take(weight) is weight  # the writer is writing it
    stepped = threading.Event()
    thread = threading.Thread(target=lambda: (opt.step(), stepped.set()))
    thread.start()
    assert not stepped.wait(0.3), "the step changed a tensor the writer was still writing"
    copies.done(weight)
    assert stepped.wait(30)
    thread.join()


def test_each_save_reuses_its_buffers_and_replaces_the_previous_saves_hook():
    model, opt = model_and_optimizer()
    copies = DeferredCopies()
    first = copies.stage(state_of(model, opt), opt)
    opt.step()
    second = copies.stage(state_of(model, opt), opt)
    assert len(opt._optimizer_step_pre_hooks) == 1, "one hook: the previous save's is removed"
    assert second["model"]["1.running_mean"].data_ptr() == first["model"]["1.running_mean"].data_ptr()
    bias = second["model"]["0.bias"]
    copies.release()
    copy_of_bias = copies.take(bias)
    assert copy_of_bias is not bias and torch.equal(copy_of_bias, bias)
    bias.data.add_(1.0)
    copies.release()  # once per save: a later call copies nothing again
    assert copies.take(bias) is copy_of_bias and not torch.equal(copy_of_bias, bias)
