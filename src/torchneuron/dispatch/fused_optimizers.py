"""`torch.optim.Adam(..., fused=True)` and `AdamW(..., fused=True)` on neuron.

The fused kernels (`aten._fused_adam_`, `aten._fused_adamw_`) update every
parameter, gradient and moment in place in one call over lists; they do not
export (functionalization refuses the in-place list update), so they ran on
the host path, and Transformers' Trainer picks the fused AdamW by default.
Here they are the same update through the device's multi-tensor (`_foreach_`)
ops, each of which compiles, with the step counts read on the device (no host
sync), as torch.optim's capturable multi-tensor Adam computes it. CPU's fused
kernel's order of operations is followed where it differs: decoupled weight
decay scales the parameter first, `grad_scale` divides the gradients in place,
and a `found_inf` of 1 leaves everything untouched."""

from __future__ import annotations

import torch


def _update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
            weight_decay, eps, amsgrad, maximize, grad_scale, found_inf, decoupled):
    if not params:
        return None
    if found_inf is not None and found_inf.item() == 1.0:
        return None  # the step GradScaler skips
    if isinstance(lr, torch.Tensor):
        lr = lr.item()
    if grad_scale is not None:
        torch._foreach_div_(grads, grad_scale)
    if maximize:
        grads = torch._foreach_neg(grads)
    if weight_decay != 0:
        if decoupled:
            torch._foreach_mul_(params, 1 - lr * weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    # step_size = -lr / (1 - beta1^t) and sqrt(1 - beta2^t), from the step tensors
    bias_correction1 = torch._foreach_pow(beta1, state_steps)
    bias_correction2 = torch._foreach_pow(beta2, state_steps)
    torch._foreach_sub_(bias_correction1, 1)
    torch._foreach_sub_(bias_correction2, 1)
    torch._foreach_neg_(bias_correction2)
    torch._foreach_div_(bias_correction1, lr)
    torch._foreach_reciprocal_(bias_correction1)
    torch._foreach_sqrt_(bias_correction2)
    if amsgrad:
        torch._foreach_maximum_(max_exp_avg_sqs, exp_avg_sqs)
        denominator = torch._foreach_sqrt(max_exp_avg_sqs)
    else:
        denominator = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denominator, bias_correction2)
    torch._foreach_add_(denominator, eps)
    torch._foreach_div_(denominator, bias_correction1)
    torch._foreach_addcdiv_(params, exp_avgs, denominator)
    return None


def fused_adam_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr, beta1=beta1,
                   beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                   grad_scale=grad_scale, found_inf=found_inf, decoupled=False)


def fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    return _update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr, beta1=beta1,
                   beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                   grad_scale=grad_scale, found_inf=found_inf, decoupled=True)


REWRITES = {
    "aten._fused_adam_.default": fused_adam_,
    "aten._fused_adam_.tensor_lr": fused_adam_,
    "aten._fused_adamw_.default": fused_adamw_,
    "aten._fused_adamw_.tensor_lr": fused_adamw_,
}
