/**
 * A notebook whose kernel another page starts joins it once it is up.
 *
 * Notebook 7's "New > <kernel>" starts the kernel from the file browser's page and opens
 * the notebook in a new tab at once; the tab looks for the notebook's session once, as it
 * opens. A sandboxed kernel takes seconds to start, and its session takes the notebook's
 * path only then (JupyterLab starts a session under a temporary name and renames it once
 * the kernel is up): the tab found none, showed "No Kernel" and a Select Kernel dialog,
 * the kernel idle on the server. A local kernel is up before the tab looks.
 *
 * So a notebook that has no kernel and starts none looks again for a while, and joins the
 * session that appears for its path, closing the Select Kernel dialog that asked for one.
 */
import {
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { Dialog, ISessionContext } from '@jupyterlab/apputils';
import { PathExt } from '@jupyterlab/coreutils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Session } from '@jupyterlab/services';

/** How long after it opens a notebook looks for a session another page starts (ms). */
const LOOK_FOR = 60000;
/** How often it looks (ms). */
const EVERY = 500;

/** What SessionContext does with a session it finds as it initializes (not public API). */
interface IAdopting {
  _handleNewSession?(session: Session.ISessionConnection): unknown;
}

async function joinLateSession(
  sessions: Session.IManager,
  panel: NotebookPanel
): Promise<void> {
  const context: ISessionContext = panel.sessionContext;
  await panel.context.ready;
  const until = Date.now() + LOOK_FOR;
  while (Date.now() < until) {
    await new Promise(resolve => setTimeout(resolve, EVERY));
    if (context.isDisposed || context.session?.kernel) {
      return;
    }
    // "No Kernel" without a session: none found, none being started by this page.
    if (!context.hasNoKernel || context.session) {
      continue;
    }
    await sessions.refreshRunning();
    let model: Session.IModel | undefined;
    for (const running of sessions.running()) {
      if (running.path === context.path && running.kernel) {
        model = running;
      }
    }
    if (!model || context.isDisposed || context.session) {
      continue;
    }
    const adopting = context as unknown as IAdopting;
    if (typeof adopting._handleNewSession === 'function') {
      // As SessionContext does with the session it finds as it initializes.
      adopting._handleNewSession(sessions.connectTo({ model }));
    } else {
      await context.changeKernel({ id: model.kernel!.id });
    }
    closeKernelQuestion(PathExt.basename(context.path));
    return;
  }
}

/** Dismiss the Select Kernel dialog asked for the notebook ``name``. */
function closeKernelQuestion(name: string): void {
  Dialog.tracker.forEach(dialog => {
    const node = dialog.node;
    if (node.querySelector('select') && node.textContent?.includes(`"${name}"`)) {
      dialog.reject();
    }
  });
}

export const lateSession: JupyterFrontEndPlugin<void> = {
  id: 'sandbox-kernel:late-session',
  description:
    'A notebook whose kernel another page is still starting (Notebook 7: New > kernel) joins it once it is up.',
  autoStart: true,
  requires: [INotebookTracker],
  activate: (app: JupyterFrontEnd, notebooks: INotebookTracker) => {
    notebooks.widgetAdded.connect((_, panel) => {
      void joinLateSession(app.serviceManager.sessions, panel);
    });
  }
};
