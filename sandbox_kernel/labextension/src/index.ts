/**
 * sandbox-kernel in JupyterLab's status bar: which sandbox the current notebook's or
 * console's kernel runs in and how close it is to its limits ("gVisor · no network ·
 * 1.2/2.0 GiB"), or that it is paused or resuming. A click shows the kernel's policy; a
 * limit that stops the kernel gets a notice. And the sandbox's approval questions close
 * once nobody waits for their answer. The server side is sandbox_kernel/lab.py.
 *
 * On a user's server whose kernels run on a sandbox gateway (another machine), the item
 * says when that host does not answer, and once it answers again, reconnects a kernel
 * connection JupyterLab gave up on, so the notebook runs on without a reload.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import {
  Dialog,
  ISessionContext,
  Notification,
  showDialog
} from '@jupyterlab/apputils';
import type { CodeCell } from '@jupyterlab/cells';
import { ConsolePanel, IConsoleTracker } from '@jupyterlab/console';
import { URLExt } from '@jupyterlab/coreutils';
import {
  INotebookTracker,
  NotebookActions,
  NotebookPanel
} from '@jupyterlab/notebook';
import type { IStdin, OutputArea } from '@jupyterlab/outputarea';
import { Kernel, ServerConnection } from '@jupyterlab/services';
import { IStatusBar } from '@jupyterlab/statusbar';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { lateSession } from './latesession';

/** How often the current sandboxed kernel is asked about (ms). */
const INTERVAL = 3000;
/** ... while it pauses or resumes, which takes seconds. */
const SWITCHING_INTERVAL = 500;
/**
 * How long a kernel this page woke is shown resuming although the server still says
 * paused (its message may not have reached the kernel's bridge yet), in ms.
 */
const WAKING = 3000;
/** A question of the sandbox's (sandbox_kernel/approval.py), and its wait in seconds. */
const QUESTION = /^Sandbox: allow .*no answer within ([\d.]+) s denies:\s*$/s;
/** How long past its wait a question's box stays, for an answer on its way (ms). */
const QUESTION_GRACE = 1000;
const GiB = 1024 ** 3;
const MiB = 1024 ** 2;

/** What `GET /api/sandbox-kernel/kernels/<id>` answers for a sandboxed kernel. */
interface ISandbox {
  sandboxed: true;
  runtime: string;
  docker_runtime: string;
  image: string;
  network: 'none' | 'allowlist';
  allowed_domains: string[];
  /** Domains allowed at an approval question, for this kernel from now on. */
  approved_domains: string[];
  /** For a kernel that asks before it leaves its allow-list. */
  approval: { timeout: number } | null;
  limits: {
    memory: string;
    cpus: number;
    pids: number;
    tmp_size: string;
    file_size: string;
    exec_timeout: number;
    idle_timeout: number;
    output_limit: string;
  };
  memory: { used: number | null; limit: number };
  state: 'running' | 'pausing' | 'paused' | 'resuming';
  stopped: IStop | null;
}

/** The last time a limit stopped the kernel. */
interface IStop {
  ename: string;
  /** "memory", "wall-clock" or "idle". */
  limit: string;
  reason: string;
  /** When (ISO 8601), and how many seconds ago. */
  time: string;
  age: number;
  /** False once the kernel runs again. */
  current: boolean;
}

/**
 * What the route answers on a user's server when the sandbox gateway, where the kernel
 * runs, cannot be reached (sandbox_kernel/jupyter/gateway_client.py).
 */
interface IGatewayLost {
  sandboxed: true;
  gateway: { reachable: false; url: string; reason: string };
}

/**
 * The sandbox of kernel `kernelId`, or that its sandbox host cannot be reached; null if
 * it is not sandboxed or gone.
 */
async function fetchSandbox(
  settings: ServerConnection.ISettings,
  kernelId: string
): Promise<ISandbox | IGatewayLost | null> {
  const url = URLExt.join(
    settings.baseUrl,
    'api/sandbox-kernel/kernels',
    encodeURIComponent(kernelId)
  );
  const response = await ServerConnection.makeRequest(url, {}, settings);
  if (response.status === 404) {
    return null;
  }
  if (!response.ok) {
    throw new ServerConnection.ResponseError(response);
  }
  const data = await response.json();
  if (!data.sandboxed) {
    return null;
  }
  return data.gateway?.reachable === false
    ? (data as IGatewayLost)
    : (data as ISandbox);
}

/** The status bar's text while the sandbox host does not answer. */
const LOST_TEXT = 'sandbox host unreachable: retrying';

/** The status bar's tooltip while the sandbox host does not answer. */
function lostTitle({ gateway }: IGatewayLost): string {
  return (
    `The sandbox host (${gateway.url}) that runs this kernel does not answer: ` +
    `${gateway.reason}. This notebook reconnects once it answers again; a persistent ` +
    'kernel keeps its variables meanwhile.'
  );
}

function memoryText({ used, limit }: ISandbox['memory']): string {
  const [unit, name, digits] = limit >= GiB ? [GiB, 'GiB', 1] : [MiB, 'MiB', 0];
  const amount = (bytes: number) => (bytes / unit).toFixed(digits);
  return `${used === null ? '–' : amount(used)}/${amount(limit)} ${name}`;
}

function networkText(sandbox: ISandbox): string {
  const n = sandbox.allowed_domains.length + sandbox.approved_domains.length;
  return sandbox.network === 'none'
    ? 'no network'
    : `${n} ${n === 1 ? 'domain' : 'domains'}`;
}

/** What a kernel that does not run says instead of its memory. */
const STATE_TEXT: Record<ISandbox['state'], string> = {
  running: '',
  pausing: 'pausing…',
  paused: 'paused',
  resuming: 'resuming…'
};

/** The status bar's text, e.g. "gVisor · no network · 1.2/2.0 GiB". */
function statusText(sandbox: ISandbox): string {
  if (sandbox.stopped?.current) {
    return `${sandbox.runtime} · stopped: ${sandbox.stopped.limit} limit`;
  }
  return [
    sandbox.runtime,
    networkText(sandbox),
    STATE_TEXT[sandbox.state] || memoryText(sandbox.memory)
  ].join(' · ');
}

/** The status bar's tooltip. */
function statusTitle(sandbox: ISandbox): string {
  switch (sandbox.state) {
    case 'paused':
      return (
        'This sandboxed kernel is paused: its memory is saved to disk and its container ' +
        'stopped, every variable kept. The next cell resumes it, which takes a few seconds.'
      );
    case 'resuming':
      return 'This sandboxed kernel is resuming from disk: the cell runs once it is back.';
    case 'pausing':
      return 'This sandboxed kernel is being paused: its memory is saved to disk.';
  }
  const network =
    sandbox.network === 'none'
      ? 'no network'
      : `HTTP(S) to ${allDomains(sandbox).join(', ')} only`;
  return (
    `Sandboxed kernel (${sandbox.runtime}, image ${sandbox.image}): ${network}` +
    `; memory ${memoryText(sandbox.memory)} in use. Click for its policy.`
  );
}

/** The domains the kernel may reach: its own, then those allowed at a question. */
function allDomains(sandbox: ISandbox): string[] {
  return [
    ...sandbox.allowed_domains,
    ...sandbox.approved_domains.map(domain => `${domain} (allowed at the prompt)`)
  ];
}

function seconds(value: number): string {
  return value > 0 ? `${value} s` : 'none';
}

/** A short notice (JupyterLab shows at most 140 characters of it). */
function stopNotice(sandbox: ISandbox, stop: IStop): string {
  const { limits } = sandbox;
  switch (stop.limit) {
    case 'memory':
      return `The sandboxed kernel reached its memory limit (${limits.memory}) and was stopped; its variables are lost.`;
    case 'wall-clock':
      return `The sandboxed kernel was stopped: an execution ran past its wall-clock limit (${limits.exec_timeout} s); its variables are lost.`;
    case 'idle':
      return `The sandboxed kernel was stopped after ${limits.idle_timeout} s without executions (idle limit). Restart it to go on.`;
    default:
      return `The sandboxed kernel was stopped by a limit (${stop.ename}).`;
  }
}

/** The policy, as rows of a table: [what, value]. */
function policyRows(sandbox: ISandbox): [string, string][] {
  const { limits, memory } = sandbox;
  const network =
    sandbox.network === 'none'
      ? 'none: no network at all'
      : `allow-list: HTTP(S) to ${allDomains(sandbox).join(', ')} only, through the host's proxy`;
  const rows: [string, string][] = [
    [
      'Runtime',
      `${sandbox.runtime} (Docker runtime ${sandbox.docker_runtime})`
    ],
    ['Image', sandbox.image],
    ['Network', network],
    ...(sandbox.approval
      ? ([
          [
            'Other domains',
            'asked about at a prompt (those the server allows); no answer within ' +
              `${sandbox.approval.timeout} s denies`
          ]
        ] as [string, string][])
      : []),
    [
      'Memory',
      `${limits.memory}` +
        (memory.used === null ? '' : ` (${memoryText(memory)} in use)`)
    ],
    ['CPUs', `${limits.cpus}`],
    ['Processes and threads', `${limits.pids}`],
    ['/tmp', limits.tmp_size],
    ['Largest file written', limits.file_size],
    ['Output per execution', limits.output_limit],
    ['Wall-clock limit per execution', seconds(limits.exec_timeout)],
    ['Idle limit', seconds(limits.idle_timeout)]
  ];
  if (sandbox.stopped) {
    const { stopped } = sandbox;
    rows.push([
      stopped.current ? 'Stopped' : 'Last stopped',
      `${stopped.reason} (${new Date(stopped.time).toLocaleString()})`
    ]);
  }
  return rows;
}

/** A dialog with the kernel's policy. */
function showPolicy(sandbox: ISandbox): Promise<unknown> {
  const body = new Widget();
  body.addClass('sandbox-kernel-policy');
  const table = document.createElement('table');
  for (const [what, value] of policyRows(sandbox)) {
    const row = table.insertRow();
    const th = document.createElement('th');
    th.textContent = what;
    row.appendChild(th);
    row.insertCell().textContent = value;
  }
  body.node.appendChild(table);
  return showDialog({
    title: 'Sandboxed kernel',
    body,
    buttons: [Dialog.okButton({ label: 'Close' })]
  });
}

/**
 * The status-bar item. It asks the server about the current kernel every few seconds
 * while that kernel is sandboxed, and not at all otherwise.
 */
class SandboxStatus extends Widget {
  constructor(private readonly _settings: ServerConnection.ISettings) {
    super();
    this.id = 'sandbox-kernel-status';
    this.addClass('jp-StatusBar-TextItem');
    this.addClass('jp-mod-highlighted');
    this.addClass('sandbox-kernel-status');
    this.node.setAttribute('role', 'button');
    this.node.tabIndex = 0;
    this.node.addEventListener('click', () => this._showPolicy());
    this.node.addEventListener('keydown', event => {
      if (event.key === 'Enter' || event.key === ' ') {
        this._showPolicy();
      }
    });
    this._poll = new Poll({
      auto: false,
      factory: () => this._check(),
      frequency: { interval: INTERVAL, backoff: true, max: 10 * INTERVAL },
      name: 'sandbox-kernel:status',
      standby: 'when-hidden'
    });
  }

  /** Whether the current kernel is sandboxed (the item shows only then). */
  get active(): boolean {
    return this._sandbox !== null || this._lost !== null;
  }

  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  /** The current notebook's or console's session, or null. */
  set sessionContext(context: ISessionContext | null) {
    if (context === this._context) {
      return;
    }
    this._context?.kernelChanged.disconnect(this._kernelChanged, this);
    this._context = context;
    context?.kernelChanged.connect(this._kernelChanged, this);
    this._kernelChanged();
  }

  dispose(): void {
    this._poll.dispose();
    super.dispose();
  }

  private _kernelChanged(): void {
    const kernel = this._context?.session?.kernel ?? null;
    if (kernel !== this._kernel) {
      this._kernel?.anyMessage.disconnect(this._onMessage, this);
      this._kernel = kernel;
      kernel?.anyMessage.connect(this._onMessage, this);
      this._wokenAt = 0;
    }
    this._show(null);
    void this._poll.refresh();
  }

  /** A message to a paused kernel wakes it: say so at once, then follow it closely. */
  private _onMessage(_: Kernel.IKernelConnection, args: Kernel.IAnyMessageArgs): void {
    if (args.direction !== 'send' || this._sandbox?.state !== 'paused') {
      return;
    }
    this._wokenAt = Date.now();
    this._show({ ...this._sandbox, state: 'resuming' });
    void this._poll.refresh();
  }

  private get _kernelId(): string | null {
    return this._context?.session?.kernel?.id ?? null;
  }

  private async _check(): Promise<void> {
    const kernelId = this._kernelId;
    const answer = kernelId
      ? await fetchSandbox(this._settings, kernelId)
      : null;
    if (kernelId !== this._kernelId) {
      return; // another kernel meanwhile: its own check follows
    }
    if (answer !== null && 'gateway' in answer) {
      this._showLost(answer);
      return; // asked again at the usual interval
    }
    const sandbox = answer;
    if (sandbox !== null) {
      this._reconnect(); // the kernel is there: a connection given up on can come back
    }
    if (sandbox?.state === 'paused' && Date.now() - this._wokenAt < WAKING) {
      sandbox.state = 'resuming'; // our message is on its way to the kernel
    }
    this._show(sandbox);
    const switching =
      sandbox?.state === 'pausing' || sandbox?.state === 'resuming';
    const interval = switching ? SWITCHING_INTERVAL : INTERVAL;
    if (this._poll.frequency.interval !== interval) {
      this._poll.frequency = { ...this._poll.frequency, interval };
    }
    if (kernelId === null || sandbox === null) {
      void this._poll.stop();
      return;
    }
    if (sandbox.stopped) {
      this._notice(kernelId, sandbox, sandbox.stopped);
    }
  }

  /**
   * The server answers for the kernel, and has it: if JupyterLab gave its connection up
   * meanwhile ("disconnected": a socket closed as going away, 1000 or 1001, or 7 failed
   * tries in a row), try again, as "Reconnect to Kernel" does.
   */
  private _reconnect(): void {
    const kernel = this._kernel;
    if (
      kernel === null ||
      kernel.isDisposed ||
      kernel.status === 'dead' ||
      kernel.connectionStatus !== 'disconnected'
    ) {
      return;
    }
    console.info(`sandbox-kernel: reconnecting kernel ${kernel.id}`);
    kernel.reconnect().catch(reason => {
      console.warn(`sandbox-kernel: kernel ${kernel.id} did not reconnect`, reason);
    });
  }

  /** Once per stop: a notice, unless the stop is older than this page and over. */
  private _notice(kernelId: string, sandbox: ISandbox, stop: IStop): void {
    const key = `${kernelId} ${stop.time}`;
    if (this._noticed.has(key)) {
      return;
    }
    this._noticed.add(key);
    if (!stop.current && Date.now() - stop.age * 1000 < this._since) {
      return;
    }
    Notification.error(stopNotice(sandbox, stop), {
      autoClose: false,
      actions: [{ label: 'Details', callback: () => void showPolicy(sandbox) }]
    });
  }

  /** Say that the sandbox host does not answer, instead of figures it cannot update. */
  private _showLost(lost: IGatewayLost): void {
    const wasActive = this.active;
    this._lost = lost;
    this._sandbox = null;
    this.node.textContent = LOST_TEXT;
    this.node.title = lostTitle(lost);
    this.toggleClass('sandbox-kernel-mod-stopped', true);
    this.toggleClass('sandbox-kernel-mod-near-limit', false);
    this.toggleClass('sandbox-kernel-mod-asleep', false);
    if (this.active !== wasActive) {
      this._activeChanged.emit();
    }
  }

  private _show(sandbox: ISandbox | null): void {
    const wasActive = this.active;
    this._lost = null;
    this._sandbox = sandbox;
    if (sandbox === null) {
      this.node.textContent = '';
      this.node.title = '';
    } else {
      const { used, limit } = sandbox.memory;
      const stopped = sandbox.stopped?.current ?? false;
      this.node.textContent = statusText(sandbox);
      this.node.title = stopped
        ? `This sandboxed kernel was stopped: ${sandbox.stopped?.reason}`
        : statusTitle(sandbox);
      this.toggleClass('sandbox-kernel-mod-stopped', stopped);
      this.toggleClass(
        'sandbox-kernel-mod-near-limit',
        !stopped && used !== null && used >= 0.8 * limit
      );
      this.toggleClass(
        'sandbox-kernel-mod-asleep',
        !stopped && sandbox.state !== 'running'
      );
    }
    if (this.active !== wasActive) {
      this._activeChanged.emit();
    }
  }

  private _showPolicy(): void {
    if (this._sandbox) {
      void showPolicy(this._sandbox);
    }
  }

  private _context: ISessionContext | null = null;
  private _kernel: Kernel.IKernelConnection | null = null;
  /** When this page last sent a message to the kernel while it was paused (ms). */
  private _wokenAt = 0;
  private _sandbox: ISandbox | null = null;
  /** What the server said while the sandbox host did not answer. */
  private _lost: IGatewayLost | null = null;
  private _poll: Poll;
  private _noticed = new Set<string>();
  private _since = Date.now();
  private _activeChanged = new Signal<this, void>(this);
}

/**
 * Closes the box of a sandbox's approval question once nobody waits for its answer:
 * its wait is over (the request was denied) or the cell has ended. Jupyter has no
 * message that withdraws an input request, and JupyterLab keeps the box, and its guard
 * against running any other cell ("Cell not executed due to pending input"), until
 * something is typed into it.
 */
class QuestionCloser {
  /** Follow the input requests of ``area``, whose kernel is ``context``'s. */
  watch(area: OutputArea, context: ISessionContext): void {
    if (this._watched.has(area)) {
      return;
    }
    this._watched.add(area);
    area.inputRequested.connect((_, stdin) => this._asked(area, stdin, context));
  }

  private _asked(
    area: OutputArea,
    stdin: IStdin,
    context: ISessionContext
  ): void {
    const prompt =
      stdin.node.querySelector('.jp-Stdin-prompt')?.textContent ?? '';
    const question = QUESTION.exec(prompt);
    if (!question) {
      return; // the kernel's own input(): the kernel decides how long it waits
    }
    let open = true;
    const close = () => {
      if (!open) {
        return;
      }
      open = false;
      window.clearTimeout(timer);
      const panel = area.node.closest('.jp-NotebookPanel, .jp-ConsolePanel');
      (stdin.parent ?? stdin).dispose(); // the box and its prompt
      if (!panel?.querySelector('.jp-Stdin')) {
        context.session?.kernel?.removeInputGuard();
      }
    };
    const timer = window.setTimeout(
      close,
      Number(question[1]) * 1000 + QUESTION_GRACE
    );
    void stdin.value.then(() => {
      open = false; // answered: JupyterLab takes the box away itself
      window.clearTimeout(timer);
    });
    area.future?.done.then(close, close);
  }

  private _watched = new WeakSet<OutputArea>();
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'sandbox-kernel:status',
  description:
    "Shows the current kernel's sandbox and limits in the status bar, and when a limit stopped it.",
  autoStart: true,
  // Without a status bar (Notebook 7), the notices still come.
  optional: [IStatusBar, INotebookTracker, IConsoleTracker],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    notebooks: INotebookTracker | null,
    consoles: IConsoleTracker | null
  ) => {
    const status = new SandboxStatus(app.serviceManager.serverSettings);
    statusBar?.registerStatusItem(plugin.id, {
      item: status,
      align: 'left',
      rank: 100,
      isActive: () => status.active,
      activeStateChanged: status.activeChanged
    });
    const current = (): ISessionContext | null => {
      const widget = app.shell.currentWidget;
      if (widget && notebooks?.has(widget)) {
        return (widget as NotebookPanel).sessionContext;
      }
      if (widget && consoles?.has(widget)) {
        return (widget as ConsolePanel).sessionContext;
      }
      return null;
    };
    app.shell.currentChanged?.connect(() => {
      status.sessionContext = current();
    });
    const closer = new QuestionCloser();
    NotebookActions.executionScheduled.connect((_, { notebook, cell }) => {
      const panel = notebooks?.find(widget => widget.content === notebook);
      if (panel && cell.model.type === 'code') {
        closer.watch((cell as CodeCell).outputArea, panel.sessionContext);
      }
    });
    const watchConsole = (panel: ConsolePanel) => {
      const watch = () => {
        const cell = panel.console.promptCell;
        if (cell) {
          closer.watch(cell.outputArea, panel.sessionContext);
        }
      };
      panel.console.promptCellCreated.connect(watch);
      watch();
    };
    consoles?.forEach(watchConsole);
    consoles?.widgetAdded.connect((_, panel) => watchConsole(panel));
    void app.restored.then(() => {
      status.sessionContext = current();
    });
  }
};

export default [plugin, lateSession];
